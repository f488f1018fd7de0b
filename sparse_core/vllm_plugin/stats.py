"""vLLM scheduler statistics as our `EngineStats`, through vLLM's stat-logger seam."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from sparse_core.engine.llm_engine import EngineStats


class StatsSink(StatLoggerBase):
    """Hands every scheduler update to `publish` as `EngineStats` (KV blocks as one group,
    "vllm": vLLM pools every KV cache group's blocks together)."""

    def __init__(self, vllm_config: Any, publish: Callable[[EngineStats], None]) -> None:
        self.vllm_config = vllm_config
        self.publish = publish
        self.preemptions = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if iteration_stats is not None:
            self.preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)
        if scheduler_stats is None:
            return
        total, used = kv_blocks(
            self.vllm_config.cache_config.num_gpu_blocks or 1, scheduler_stats.kv_cache_usage
        )
        self.publish(
            EngineStats(
                num_running=scheduler_stats.num_running_reqs,
                num_waiting=scheduler_stats.num_waiting_reqs,
                num_preemptions=self.preemptions,
                kv_blocks={"vllm": {"total": total, "used": used, "free": total - used}},
            )
        )

    def log_engine_initialized(self) -> None:
        pass


def kv_blocks(num_gpu_blocks: int, usage: float) -> tuple[int, int]:
    """Usable and used KV blocks from vLLM's block count and its usage fraction (which leaves
    out vLLM's null block)."""
    usable = max(num_gpu_blocks - 1, 0)
    return usable, round(usage * usable)


def vllm_metrics(llm: Any) -> dict[str, Any]:
    """An offline `vllm.LLM`'s own metrics by name (it needs `disable_log_stats=False`)."""
    return {m.name: m for m in llm.llm_engine.get_metrics()}


def free_blocks(metrics: dict[str, Any]) -> int:
    """Free KV blocks, from `vllm_metrics`."""
    usable, used = kv_blocks(
        int(metrics["vllm:cache_config_info"].labels["num_gpu_blocks"]),
        metrics["vllm:kv_cache_usage_perc"].value,
    )
    return usable - used

"""Start-up memory budgeting: how large the KV cache is, allocated and, on a GPU, fitted to the
process's memory limit (docs/architecture.md, "Sizing the cache")."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sparse_core.config import EngineConfig
from sparse_core.engine.cuda_graphs import decode_graph_bytes
from sparse_core.engine.gpu_memory import gpu_memory_outside_torch

if TYPE_CHECKING:
    from sparse_core.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GB = 2.0
# GPU memory taken outside torch's allocator after the KV cache is sized: kernel modules loaded
# on first use and library workspaces; without this margin a process at its limit ends up
# above it (docs/benchmarks.md, "Engine internals").
LATE_RUNTIME_BYTES = 64 * 2**20
# How far below its memory limit a started engine may be before its KV cache is enlarged (above
# it, the cache is always made smaller).
REFIT_SLACK_BYTES = 256 * 2**20


def start_kv_cache(runner: ModelRunner, config: EngineConfig, vocab_size: int) -> int:
    """Profile the largest step's activations, capture the prefill graphs, then size, allocate
    and fit the KV cache (with the decode graphs over it); returns its blocks.
    `vocab_size`: the model's, for the decode graphs' estimate."""
    # The activation profile runs eagerly, before any graph exists.
    activations = _profile_activations(runner, config)
    prefill_graphs = runner.capture_prefill_graphs()
    kv_bytes = kv_cache_bytes(runner, config, vocab_size, activations, prefill_graphs)
    return fit_kv_cache(runner, config, kv_bytes, activations)


def _profile_activations(runner: ModelRunner, config: EngineConfig) -> int:
    """Bytes of the largest step's activations, when the KV cache is sized by them."""
    if not _sized_by_gpu_memory(runner, config):
        return 0
    return runner.profile_activation_bytes()


def _sized_by_gpu_memory(runner: ModelRunner, config: EngineConfig) -> bool:
    """Whether the KV cache takes what GPU memory leaves (not kv_cache_memory_gb, not CPU)."""
    return config.kv_cache_memory_gb is None and runner.device.type == "cuda"


def _allocate_kv_cache(runner: ModelRunner, kv_bytes: int) -> int:
    """The KV cache of `kv_bytes` allocated in blocks, then the decode graphs over it captured;
    returns its blocks."""
    blocks = runner.retention.num_blocks(kv_bytes)
    runner.allocate_kv_cache(blocks)
    runner.capture_decode_graphs()
    return blocks


def fit_kv_cache(runner: ModelRunner, config: EngineConfig, kv_bytes: int, activations: int) -> int:
    """Allocate the KV cache sized at start-up; if the process then holds more GPU memory than
    its limit leaves beside the largest step's `activations`, or less by over
    REFIT_SLACK_BYTES (what the allocator reuses, and the decode graphs, are estimates),
    allocate it once more, corrected by the difference, so that the whole process, CUDA
    context included, fits the limit as it would a card of that size. Returns its blocks."""
    blocks = _allocate_kv_cache(runner, kv_bytes)
    if not _sized_by_gpu_memory(runner, config):  # the allocator stays uncapped
        return blocks
    limit = gpu_memory_limit(runner, config)
    blocks = _refit_kv_cache(runner, config, kv_bytes, activations, limit, blocks)
    # The allocator holds no more than the limit leaves beside what the process holds outside
    # it: at that cap it returns cached free blocks to the device before it takes more (as it
    # would on a card of that size), rather than growing past the limit by what it caches.
    runner.cap_allocator(int(limit - gpu_memory_outside_torch(runner.device)) - LATE_RUNTIME_BYTES)
    return blocks


def _refit_kv_cache(
    runner: ModelRunner,
    config: EngineConfig,
    kv_bytes: int,
    activations: int,
    limit: float,
    blocks: int,
) -> int:
    """The cache allocated again, by how far the process is from its limit, if it is over it
    or under it by more than REFIT_SLACK_BYTES; else `blocks` as they are."""
    device = runner.device
    used = torch.cuda.memory_reserved(device) + gpu_memory_outside_torch(device)
    # The profiled step's activations were released before the cache was allocated; a step
    # takes them again. (The allocator's cached free blocks are not counted on: much of them
    # belongs to the CUDA graphs' private pools, which eager steps cannot use.)
    room = int(limit - used - activations) - LATE_RUNTIME_BYTES
    room = min(room, torch.cuda.mem_get_info(device)[0] - activations - LATE_RUNTIME_BYTES)
    if 0 <= room <= REFIT_SLACK_BYTES:
        return blocks
    logger.info(
        "GPU memory after start-up: %.2f GiB; KV cache resized by %+.2f GiB to fit the limit",
        used / 2**30,
        room / 2**30,
    )
    runner.release_kv_cache()
    return _allocate_kv_cache(runner, kv_bytes + room)


def gpu_memory_limit(runner: ModelRunner, config: EngineConfig) -> float:
    """Bytes this process may hold on its GPU."""
    limit = torch.cuda.mem_get_info(runner.device)[1] * config.gpu_memory_utilization
    if config.gpu_memory_limit_gb is not None:
        limit = min(limit, config.gpu_memory_limit_gb * 2**30)
    return limit


def kv_cache_bytes(
    runner: ModelRunner,
    config: EngineConfig,
    vocab_size: int,
    activations: int,
    prefill_graphs: int,
) -> int:
    """prefill_graphs: bytes the prefill graphs' pool took (captured already)."""
    if config.kv_cache_memory_gb is not None:
        return int(config.kv_cache_memory_gb * 2**30)
    device = runner.device
    if device.type != "cuda":
        return int(CPU_DEFAULT_KV_CACHE_GB * 2**30)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    limit = gpu_memory_limit(runner, config)
    # What torch's allocator holds now: the weights, the prefill graphs' pool, and the
    # segments that loading left partly used (FP8 weights quantized from bf16 ones leave
    # some), which the parameters' size alone would miss. Later allocations reuse part of
    # those: `fit_kv_cache` corrects for what this over-counts.
    torch.cuda.empty_cache()  # the profiled step's activations are counted apart
    held = torch.cuda.memory_reserved(device)
    outside_torch = gpu_memory_outside_torch(device) + LATE_RUNTIME_BYTES
    # The decode graphs are captured after the KV cache is allocated: their memory is an
    # estimate (the prefill graphs' pool was measured when they were captured).
    graphs = 0
    if not config.enforce_eager:
        graphs = decode_graph_bytes(
            config.max_num_seqs,
            vocab_size,
            runner.dtype.itemsize,
            config.tensor_parallel_size,
        )
    kv = int(limit - held - activations - outside_torch - graphs)
    # Other processes on the GPU (another engine replica sharing it) leave only what is free.
    free = torch.cuda.mem_get_info(device)[0]
    kv = min(kv, int(free - activations - graphs - LATE_RUNTIME_BYTES))
    logger.info(
        "GPU memory: limit %.2f GiB = held %.2f (weights %.2f, prefill graphs %.2f) + "
        "activations %.2f + other %.2f + decode graphs %.2f + KV cache %.2f",
        *(
            x / 2**30
            for x in (limit, held, weights, prefill_graphs, activations, outside_torch,
                      graphs, kv)
        ),
    )  # fmt: skip
    if kv <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: the limit is {limit / 2**30:.2f} GiB and "
            f"weights, graphs and activations already take "
            f"{(held + activations + graphs) / 2**30:.2f} GiB; "
            f"raise gpu_memory_utilization / gpu_memory_limit_gb or lower "
            f"max_num_batched_tokens / max_num_seqs"
        )
    return kv

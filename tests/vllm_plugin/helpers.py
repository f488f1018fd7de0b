"""Running vLLM step by step and reading its own KV block accounting."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Run:
    token_ids: list[list[int]]  # per prompt, in the order given
    # vLLM's free KV block count after each engine step, keyed by the tokens generated so far
    # per request (the key, not the step index, lines two runs up: a step may return nothing).
    free_blocks: dict[tuple[int, ...], int]
    groups: list[tuple[str, int | None, int]]  # (spec type, budget, layers) per KV cache group
    backends: set[str]  # attention implementations the worker's layers run
    num_gpu_blocks: int  # vLLM's KV cache, in blocks


def _worker_layout(worker) -> tuple[list, set]:
    config = worker.model_runner.kv_cache_config
    groups = [
        (
            type(g.kv_cache_spec).__name__,
            getattr(g.kv_cache_spec, "budget", None),
            len(g.layer_names),
        )
        for g in config.kv_cache_groups
    ]
    layers = worker.model_runner.compilation_config.static_forward_context.values()
    return groups, {type(layer.impl).__name__ for layer in layers if hasattr(layer, "impl")}


def run_steps(llm, prompts: list[list[int]], max_tokens: int) -> Run:
    from vllm import SamplingParams, TokensPrompt

    from sparse_core.vllm_plugin.stats import free_blocks, vllm_metrics

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    free: dict[tuple[int, ...], int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        free[tuple(len(ids) for ids in outputs.values())] = free_blocks(vllm_metrics(llm))
    # The answer crosses a process boundary as lists: back to tuples and a set.
    groups, backends = llm.collective_rpc(_worker_layout)[0]
    ids = [outputs[str(i)] for i in range(len(prompts))]
    blocks = int(vllm_metrics(llm)["vllm:cache_config_info"].labels["num_gpu_blocks"])
    return Run(ids, free, [tuple(g) for g in groups], set(backends), blocks)

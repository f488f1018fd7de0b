"""Run the same requests through an engine and record what tensor-parallel tests compare."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_core import LLM, SamplingParams
from sparse_core.distributed import COLLECTIVE_CALLS


@dataclass
class Run:
    token_ids: list[list[int]]
    logits: list[torch.Tensor]  # every step's [B, V] logits, in step order
    kv_tokens_per_group: list[dict[str, int]]
    prefill_calls: list[dict[str, int]]  # per rank: collectives issued by the first (prefill) step
    worker_kv_shapes: list[list[tuple[int, ...]]]  # per worker rank: each layer's K cache shape


def run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, late: list[list[int]] = ()
) -> Run:
    """Every prompt is admitted into the first step, so that step is one prefill of them all;
    the `late` prompts arrive after it and join the running decodes in a mixed step."""
    engine, workers = llm.engine, llm.engine.workers
    logits: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording_execute(step):
        out = execute(step)
        logits.append(out.clone())
        return out

    engine.runner.execute = recording_execute
    COLLECTIVE_CALLS.clear()
    if workers is not None:
        workers.query("reset_collective_calls")
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finished = {out.request_id: out for out in engine.step() if out.finished}
    prefill_calls = [dict(COLLECTIVE_CALLS)]
    if workers is not None:
        prefill_calls += workers.query("collective_calls")
    for i, prompt in enumerate(late, start=len(prompts)):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished:
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    outs = [finished[f"r{i}"] for i in range(len(prompts) + len(late))]
    return Run(
        token_ids=[out.token_ids for out in outs],
        logits=logits,
        kv_tokens_per_group=[out.kv_tokens_per_group for out in outs],
        prefill_calls=prefill_calls,
        worker_kv_shapes=workers.query("kv_cache_shapes") if workers is not None else [],
    )


def assert_same_logits(a: Run, b: Run, atol: float) -> None:
    assert len(a.logits) == len(b.logits)
    for step, (x, y) in enumerate(zip(a.logits, b.logits, strict=True)):
        diff = (x - y).abs().max().item()
        assert diff <= atol, f"step {step}: logits differ by {diff:.2e} (tolerance {atol:.0e})"

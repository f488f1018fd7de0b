"""The real SmolLM2-135M-Instruct (9 heads, 3 KV heads) split over 3 CPU processes (gloo):
greedy outputs equal one process's, dense and with SnapKV compressing ~300-token prompts."""

from __future__ import annotations

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from tests.distributed.tp_helpers import Run, assert_same_logits, run

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
POLICIES = {
    "dense": SparsityConfig(policy="dense"),
    "snapkv": SparsityConfig(policy="snapkv", budget=64, full_layers=2),
}


def prompts(llm: LLM) -> list[list[int]]:
    facts = [
        " ".join(f"Fact {i}: the number of item {i} is {i * k % 100}." for i in range(n))
        for k, n in ((7, 18), (13, 20))
    ]
    return [
        llm.tokenizer.encode_chat([{"role": "user", "content": f"{text} Which item is 42?"}])
        for text in facts
    ]


def engine_run(policy: str, tp: int) -> Run:
    with LLM(
        sparsity=POLICIES[policy],
        max_model_len=1024,
        kv_cache_memory_gb=0.1,
        tensor_parallel_size=tp,
    ) as llm:
        batch = prompts(llm)
        assert all(250 <= len(p) <= 400 for p in batch), [len(p) for p in batch]
        return run(llm, batch, PARAMS)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], Run]:
    return {(policy, tp): engine_run(policy, tp) for policy in POLICIES for tp in (1, 3)}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_tp3_greedy_equals_one_process(runs, policy):
    single, tp3 = runs[policy, 1], runs[policy, 3]
    assert tp3.token_ids == single.token_ids
    assert_same_logits(single, tp3, atol=1e-3)  # float32; only the summation order differs


def test_snapkv_compressed_the_prompts(runs):
    for kept in runs["snapkv", 3].kv_tokens_per_group:
        assert kept["budget64"] == 64 and kept["full"] > 250


def test_compression_issues_no_collective(runs):
    assert runs["snapkv", 3].prefill_calls == runs["dense", 3].prefill_calls
    assert runs["dense", 3].prefill_calls == [{"all_reduce": 61, "all_gather": 1}] * 3

"""The engine on the real SmolLM2-135M-Instruct: exact agreement with transformers and with itself."""

from __future__ import annotations

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.config import POLICIES
from tests.conftest import hf_greedy

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Paris is the capital of France. Berlin is the capital of",
]


def chat_prompt(llm: LLM, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def test_dense_greedy_equals_transformers(dense_llm, hf_model):
    prompts = [*PROMPTS, chat_prompt(dense_llm, "What is the capital of France?")]
    outs = dense_llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    assert sum(len(out.token_ids) == 64 for out in outs) >= 2  # most run the full length
    for out in outs:
        # transformers also stops after the end-of-sequence token and includes it.
        assert out.token_ids == hf_greedy(hf_model, out.prompt_token_ids, 64), out.prompt


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "dense"])
def test_budget_at_least_the_prompt_reproduces_dense(policy, dense_llm):
    expected = [o.token_ids for o in dense_llm.generate(PROMPTS, GREEDY_64)]
    sparse = LLM(
        sparsity=SparsityConfig(policy=policy, budget=128, window=8, sinks=2, full_layers=1),
        max_model_len=4096,
        kv_cache_memory_gb=0.5,
    )
    outs = sparse.generate(PROMPTS, GREEDY_64)
    assert [o.token_ids for o in outs] == expected
    for out in outs:  # nothing was compressed: every group kept the whole prompt
        assert set(out.kv_tokens_per_group.values()) == {len(out.prompt_token_ids)}


def long_prompt(llm: LLM, num_facts: int = 60) -> str:
    facts = " ".join(
        f"Fact {i}: the number of item {i} is {i * 7 % 100}." for i in range(num_facts)
    )
    return chat_prompt(llm, facts + " Summarise the facts above in one sentence.")


def test_batching_does_not_change_greedy_tokens_with_compression():
    llm = LLM(
        sparsity=SparsityConfig(policy="snapkv", budget=96, window=16, full_layers=2),
        max_model_len=4096,
        kv_cache_memory_gb=0.5,
    )
    prompts = [long_prompt(llm, 40), long_prompt(llm, 55), *PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params)
    assert together[0].kv_tokens_per_group["budget96"] == 96  # really compressed
    for prompt, batched in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == batched.token_ids


def test_compressed_output_reports_its_compression(dense_llm):
    llm = LLM(
        sparsity=SparsityConfig(policy="snapkv", budget=64, window=16, full_layers=[0, 1]),
        max_model_len=4096,
        kv_cache_memory_gb=0.5,
    )
    out = llm.generate([long_prompt(llm)], SamplingParams(max_tokens=8, temperature=0.0))[0]
    n = len(out.prompt_token_ids)
    assert out.kv_tokens_per_group == {"full": n, "budget64": 64}
    assert out.compression_ratio == pytest.approx(30 * n / (2 * n + 28 * 64))
    assert out.text  # still produces text


def test_chat_uses_the_model_template(dense_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = dense_llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))
    assert "Paris" in out.text
    assert out.prompt_token_ids == dense_llm.tokenizer.encode(
        dense_llm.tokenizer.apply_chat_template(messages), add_special_tokens=False
    )

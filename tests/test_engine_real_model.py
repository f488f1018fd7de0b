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


@pytest.fixture(scope="module")
def compressing_llm() -> LLM:
    return LLM(
        sparsity=SparsityConfig(policy="snapkv", budget=96, window=16, full_layers=2),
        max_model_len=4096,
        kv_cache_memory_gb=0.5,
    )


COMPRESSED_GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_batching_does_not_change_greedy_tokens_with_compression(compressing_llm):
    llm = compressing_llm
    prompts = [long_prompt(llm, 40), long_prompt(llm, 55), *PROMPTS]
    together = llm.generate(prompts, COMPRESSED_GREEDY)
    assert together[0].kv_tokens_per_group["budget96"] == 96  # really compressed
    for prompt, batched in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], COMPRESSED_GREEDY)[0]
        assert alone.token_ids == batched.token_ids


def test_prompts_joining_running_decodes_do_not_change_greedy_tokens(compressing_llm):
    """One prompt arrives per step, so each is prefilled in the same forward pass as the decode
    tokens of the sequences already running (a mixed step)."""
    llm, engine = compressing_llm, compressing_llm.engine
    prompts = [long_prompt(llm, 40), PROMPTS[0], long_prompt(llm, 55), PROMPTS[1]]
    engine.step_records = []
    finished = {}
    for i, prompt in enumerate([*prompts, None, None]):
        if prompt is not None:
            engine.add_request(str(i), prompt, COMPRESSED_GREEDY)
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    mixed = [r for r in engine.step_records if r.num_prefill_seqs and r.num_decode_seqs]
    engine.step_records = None
    assert len(mixed) == len(prompts) - 1
    assert finished["2"].kv_tokens_per_group["budget96"] == 96
    for i, prompt in enumerate(prompts):
        assert finished[str(i)].token_ids == llm.generate([prompt], COMPRESSED_GREEDY)[0].token_ids


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


def test_mlp_slices_do_not_change_greedy_tokens(dense_llm, monkeypatch):
    """A step's MLP over slices of 16 tokens (prefill steps of ~150 tokens: ten slices) gives the
    tokens of one MLP over the whole step."""
    from sparse_core.models import llama

    prompts = [*PROMPTS, " ".join(["The history of the city begins"] * 20)]
    whole = dense_llm.generate(prompts, GREEDY_64)
    monkeypatch.setattr(llama, "MLP_SLICE_TOKENS", 16)
    sliced = dense_llm.generate(prompts, GREEDY_64)
    assert [o.token_ids for o in sliced] == [o.token_ids for o in whole]

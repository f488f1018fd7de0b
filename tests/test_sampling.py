"""Sampling: seeds, top-k/top-p, stop strings and stop tokens, on the real model."""

from __future__ import annotations

import pytest

from sparse_core import LLM, SamplingParams


def test_seeded_sampling_is_reproducible_and_batch_independent(dense_llm):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    alone = dense_llm.generate(["Once upon a time"], params)[0]
    again = dense_llm.generate(["Once upon a time"], params)[0]
    mixed = dense_llm.generate(
        ["Once upon a time", "Hello", "Tell me a joke"],
        [params, SamplingParams(max_tokens=24, temperature=1.0), params],
    )
    assert alone.token_ids == again.token_ids == mixed[0].token_ids
    other_seed = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99)
    assert dense_llm.generate(["Once upon a time"], other_seed)[0].token_ids != alone.token_ids


def test_top_k_one_is_greedy(dense_llm):
    greedy = dense_llm.generate(["The weather today"], SamplingParams(max_tokens=16, temperature=0))
    top1 = dense_llm.generate(
        ["The weather today"], SamplingParams(max_tokens=16, temperature=1.5, top_k=1)
    )
    assert greedy[0].token_ids == top1[0].token_ids


def test_stop_string_is_cut_from_the_text(dense_llm):
    full = dense_llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=40, temperature=0))
    text = full[0].text
    stop = text.split("\n")[2][:6] if text.count("\n") > 2 else text[10:14]
    out = dense_llm.generate(
        ["def fibonacci(n):"], SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_stop_token_id_and_eos(dense_llm):
    full = dense_llm.generate(["The quick brown fox"], SamplingParams(max_tokens=20, temperature=0))
    target = full[0].token_ids[5]
    out = dense_llm.generate(
        ["The quick brown fox"],
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[target]),
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[0].token_ids[: full[0].token_ids.index(target) + 1]
    chat = dense_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    answer = dense_llm.generate([chat], SamplingParams(max_tokens=64, temperature=0))[0]
    assert answer.finish_reason == "stop"
    assert answer.token_ids[-1] in dense_llm.tokenizer.eos_token_ids


def test_max_tokens_none_generates_what_the_context_leaves():
    """vLLM's meaning: the prompt plus the output fill max_model_len; min_tokens is checked
    against that room."""
    llm = LLM("dummy:tiny", device="cpu", max_model_len=64, kv_cache_memory_gb=0.01)
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
    (out,) = llm.generate([list(range(1, 11))], params)
    assert len(out.token_ids) == 54 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens must be an integer in"):
        llm.generate([list(range(1, 11))], SamplingParams(max_tokens=None, min_tokens=55))
    llm.engine.check_invariants()

"""Requests with `compress_prefix_len` (the query-agnostic setting) on the real model: only the
prompt's prefix is prefilled and compressed, the rest is fed one token per step over the
compressed cache, and the request otherwise looks like any other."""

from __future__ import annotations

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.models.loader import ModelSource, load_model_source

BUDGET, WINDOW = 64, 16


def question_prompt(llm: LLM, num_facts: int = 30) -> list[int]:
    facts = " ".join(f"Fact {i}: item {i} weighs {i * 7 % 100} grams." for i in range(num_facts))
    content = facts + " How much does item 12 weigh?"
    return llm.tokenizer.encode_chat([{"role": "user", "content": content}])


def params(prefix: int | None = None, **kwargs) -> SamplingParams:
    kwargs = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, **kwargs}
    return SamplingParams(compress_prefix_len=prefix, **kwargs)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}])
def test_dense_output_does_not_depend_on_the_split(dense_llm, sampling):
    prompt = question_prompt(dense_llm, num_facts=15)  # short: a split at 1 feeds all but one
    n = len(prompt)
    splits = [None, 1, n // 2, n - 1, n]
    outs = dense_llm.generate([prompt] * len(splits), [params(p, **sampling) for p in splits])
    assert len(outs[0].token_ids) == 24
    for split, out in zip(splits, outs, strict=True):
        assert out.token_ids == outs[0].token_ids, split
        assert out.prompt_token_ids == prompt
        assert out.compression_ratio == 1.0


@pytest.fixture(scope="module")
def source() -> ModelSource:
    """The built-in model's weights, read once for the engines of this file."""
    return load_model_source("smollm2-135m-instruct")


def sparse_llm(source: ModelSource, **sparsity: object) -> LLM:
    return LLM(
        sparsity=SparsityConfig(**sparsity),
        model_source=source,
        max_model_len=2048,
        kv_cache_memory_gb=0.3,
    )


@pytest.fixture(scope="module")
def snapkv(source) -> LLM:
    return sparse_llm(source, policy="snapkv", budget=BUDGET, window=WINDOW, full_layers=[0, 1])


def test_only_the_prefix_is_compressed(snapkv):
    prompt = question_prompt(snapkv)
    n, prefix = len(prompt), len(prompt) - 20
    aware, agnostic = snapkv.generate([prompt, prompt], [params(), params(prefix)])
    assert aware.kv_tokens_per_group == {"full": n, f"budget{BUDGET}": BUDGET}
    # The 20 tokens after the prefix were fed over the compressed cache, so they are all kept.
    assert agnostic.kv_tokens_per_group == {"full": n, f"budget{BUDGET}": BUDGET + 20}
    assert agnostic.compression_ratio == pytest.approx(30 * n / (2 * n + 28 * (BUDGET + 20)))
    assert agnostic.prompt_token_ids == prompt
    assert len(agnostic.token_ids) == 24
    # The window scored different tokens: the outputs are not those of the query-aware request.
    assert agnostic.token_ids != aware.token_ids


@pytest.mark.parametrize("policy", ["snapkv", "pyramid", "streamingllm", "random"])
def test_a_prefix_within_the_budget_reproduces_dense(dense_llm, source, policy):
    prompt = question_prompt(dense_llm)
    expected = dense_llm.generate([prompt], params())[0].token_ids
    llm = sparse_llm(source, policy=policy, budget=len(prompt), window=WINDOW, full_layers=1)
    assert llm.generate([prompt], params(len(prompt) // 2))[0].token_ids == expected


def test_forced_steps_emit_nothing_and_the_first_token_comes_after_them(snapkv):
    engine = snapkv.engine
    prompt = question_prompt(snapkv)
    forced = 20
    engine.add_request("split", prompt, params(len(prompt) - forced, max_tokens=3))
    steps_before_first = 0
    while not (outs := engine.step()):
        steps_before_first += 1
        assert engine.sequences["split"].first_token_time is None
    # The prefill, then a step for each forced token but the last, whose step samples token 1.
    assert steps_before_first == forced
    assert len(outs[0].token_ids) == 1 and outs[0].first_token_time is not None
    while engine.has_unfinished:
        engine.step()
    engine.check_invariants()

"""Prefix caching on the real model (SmolLM2-135M-Instruct, float32 on CPU): a request whose
prompt starts with a cached prefix gives the tokens it gives without the cache, for every kind
of retention, and a compressing group's selection on a hit still scores the cached part (a
pass key that sits only in it is retrieved)."""

from __future__ import annotations

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.eval.tasks import TaskBuilder
from sparse_core.models.loader import load_model_source

RETENTIONS = {
    "dense": SparsityConfig(policy="dense"),
    "snapkv": SparsityConfig(policy="snapkv", budget=160, window=16, sinks=4, full_layers=2),
    "pyramid": SparsityConfig(policy="pyramid", budget=160, window=16, sinks=4, full_layers=2),
    "calibrated-4x": SparsityConfig(policy="snapkv", window=16, sinks=4,
                                    layer_budgets="auto", target_compression=4),
}  # fmt: skip
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LENGTH = 400


@pytest.fixture(scope="module")
def source():
    return load_model_source("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(source) -> tuple[list[int], list[list[int]], str]:
    """A pass-key prompt; it again and one with the same context and another question; the key."""
    sample = TaskBuilder(source.tokenizer, seed=1).build("passkey", LENGTH, 1)[0]
    context = sample.prompt_ids[: sample.context_len]
    tail = "\n\nTell me the pass key.<|im_end|>\n<|im_start|>assistant\nThe pass key is"
    other = context + source.tokenizer.encode(tail, add_special_tokens=False)
    return sample.prompt_ids, [sample.prompt_ids, other], sample.answers[0]


@pytest.fixture(scope="module")
def outputs(source, prompts):
    """Per (retention, caching): the first prompt alone, then the two others together (prefilled
    in one step); computed once."""
    first, then, _ = prompts
    done: dict[tuple[str, bool], list] = {}

    def run(name: str, caching: bool) -> list:
        if (name, caching) not in done:
            llm = LLM(sparsity=RETENTIONS[name], model_source=source, max_model_len=1024,
                      kv_cache_memory_gb=0.1, expected_input_len=LENGTH,
                      enable_prefix_caching=caching)  # fmt: skip
            with llm:
                done[name, caching] = llm.generate([first], GREEDY) + llm.generate(then, GREEDY)
                llm.engine.check_invariants()
        return done[name, caching]

    return run


@pytest.mark.parametrize("name", list(RETENTIONS))
def test_a_cache_hit_gives_the_tokens_of_a_miss(outputs, prompts, name):
    first, _, _ = prompts
    cached, plain = outputs(name, True), outputs(name, False)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert cached[0].num_cached_tokens == 0
    # Up to the last observation window (16; one token when dense), in whole blocks (16), came
    # from the cache.
    computed = 16 if RETENTIONS[name].compresses else 1
    assert cached[1].num_cached_tokens == (len(first) - computed) // 16 * 16
    assert cached[2].num_cached_tokens > 0
    assert all(o.num_cached_tokens == 0 for o in plain)
    if name != "dense":
        assert all(o.compression_ratio > 1.5 for o in cached)


def test_a_hit_still_finds_a_pass_key_that_only_the_cached_part_holds(outputs, prompts):
    """The question is computed after the hit; the key sits in the cached context, which the
    sparse layers must score and keep from for the answer to hold it."""
    _, _, key = prompts
    cached = outputs("snapkv", True)
    assert all(key in out.text for out in cached), [out.text for out in cached]

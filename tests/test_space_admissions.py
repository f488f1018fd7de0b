"""space_admissions: while sequences decode, a prompt is admitted at most every other step, on
the real SmolLM2-135M, stepping one at a time and with steps launched ahead; the tokens do not
change."""

from __future__ import annotations

import random

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.engine.llm_engine import LLMEngine
from sparse_core.models.loader import ModelSource, load_model_source

SPARSITY = SparsityConfig(policy="snapkv", budget=48, window=8, full_layers=2)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# 300 tokens each under a 512-token step: one prompt per step.
PROMPTS = [[random.Random(i).randrange(100, 40000) for _ in range(300)] for i in range(4)]


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return load_model_source("smollm2-135m-instruct", {})


def _engine(
    source: ModelSource, space_admissions: bool, async_scheduling: bool, **engine_args
) -> LLMEngine:
    engine_args = {"max_model_len": 512, "max_num_batched_tokens": 512, **engine_args}
    return LLM(
        sparsity=SPARSITY,
        model_source=source,
        kv_cache_memory_gb=0.1,
        space_admissions=space_admissions,
        async_scheduling=async_scheduling,
        **engine_args,
    ).engine


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]):
    """Every request arrives before the first step; (last output per request, the steps as a
    string: P for a step that prefilled, D for one that only decoded)."""
    engine.step_records = []
    for request in requests:
        engine.add_request(*request)
    last = {}
    while engine.has_unfinished:
        last.update((out.request_id, out) for out in engine.step())
    engine.check_invariants()
    assert all(g["used"] == 0 for g in engine.block_manager.usage().values())
    return last, "".join("P" if r.is_prefill else "D" for r in engine.step_records)


def _burst(engine: LLMEngine, params: SamplingParams) -> tuple[dict, str]:
    """Every prompt of PROMPTS with the same params (see _run)."""
    return _run(engine, [(str(i), prompt, params) for i, prompt in enumerate(PROMPTS)])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_burst_is_admitted_every_other_step_with_the_same_tokens(source, async_scheduling):
    spaced, spaced_steps = _burst(_engine(source, True, async_scheduling), GREEDY)
    plain, plain_steps = _burst(_engine(source, False, async_scheduling), GREEDY)
    assert plain_steps.startswith("PPPP")
    assert spaced_steps.startswith("PDPDPDP") and "PP" not in spaced_steps
    assert len(spaced_steps) == len(plain_steps) + 3  # one decode-only step per later prompt
    assert {k: v.token_ids for k, v in spaced.items()} == {k: v.token_ids for k, v in plain.items()}


def test_prompts_go_back_to_back_when_nothing_decodes(source):
    """One token each: every prompt finishes in its prefill step, so no sequence is decoding
    and nothing waits for a decode-only step."""
    _, steps = _burst(_engine(source, True, False), SamplingParams(max_tokens=1, ignore_eos=True))
    assert steps == "PPPP"


def test_no_prompt_could_join_the_step_after_an_admission(source):
    """So that step is launched ahead even right after a finish (LLMEngine.step)."""
    for spaced in (True, False):
        engine = _engine(source, spaced, False)
        engine.add_request("0", PROMPTS[0], GREEDY)
        engine.step()  # admits and prefills it: it decodes in the next step
        assert engine.scheduler.admits_another_prompt(10) is not spaced
        engine.step()  # a decode-only step: the next one may admit again
        assert engine.scheduler.admits_another_prompt(10)


def test_a_prompt_that_never_decodes_does_not_hold_the_next_one_back(source):
    """One prompt that generates six tokens, then three that generate one each (they end in
    their prefill step): only the first is followed by a decode-only step."""
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    requests = [("long", PROMPTS[0], GREEDY)]
    requests += [(str(i), prompt, one) for i, prompt in enumerate(PROMPTS[1:])]
    _, steps = _run(_engine(source, True, False), requests)
    assert steps.startswith("PDPPP"), steps


def test_a_compressed_prefix_counts_though_its_request_generates_one_token(source):
    """After its prefix (250 tokens: the other prompt's 300 do not fit beside it) the rest of
    the prompt is fed one token per step, as decode rows: the next prompt waits for a
    decode-only step, as after any prompt that goes on to decode."""
    requests = [
        ("prefix", PROMPTS[0], SamplingParams(max_tokens=1, compress_prefix_len=250)),
        ("next", PROMPTS[1], SamplingParams(max_tokens=1, ignore_eos=True)),
    ]
    _, steps = _run(_engine(source, True, False), requests)
    assert steps.startswith("PDP"), steps


def test_with_chunked_prefill_the_last_chunk_spaces_admissions(source):
    """Steps of 256 tokens: the step after a prompt's last chunk admits no new prompt (without
    spacing the third step would admit the third prompt beside the second's last chunk)."""
    # Async scheduling off: one step per call, so the snapshots below frame exactly it.
    engine = _engine(source, True, False, enable_chunked_prefill=True, max_num_batched_tokens=256)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    scheduler, ended_last_step, admissions, held_back = engine.scheduler, False, 0, 0
    while engine.has_unfinished:
        waiting = {seq.request_id for seq in scheduler.waiting}
        prefilling = {seq.request_id for seq in scheduler.running if seq.is_prefilling}
        decoding = any(not seq.is_prefilling for seq in scheduler.running)
        engine.step()
        admitted = waiting - {seq.request_id for seq in scheduler.waiting}
        if ended_last_step and decoding:
            assert not admitted
            held_back += bool(waiting)
        admissions += len(admitted)
        still = {seq.request_id for seq in scheduler.running if seq.is_prefilling}
        ended_last_step = bool((prefilling | admitted) - still)
    assert admissions == len(PROMPTS) and held_back

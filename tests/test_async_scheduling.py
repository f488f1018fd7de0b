"""Async scheduling (a step launched before the previous one's tokens are read, waiting prompts
joining it) gives the same outputs as stepping one at a time, on the real SmolLM2-135M, whatever ends or joins the
batch meanwhile, and frees every block."""

from __future__ import annotations

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.engine.llm_engine import LLMEngine

SPARSITY = SparsityConfig(policy="snapkv", budget=48, window=8, full_layers=2)
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "List some fruits:",
    "Paris is the capital of France. Berlin is the capital of",
]


def _llm(async_scheduling: bool, **engine_args) -> LLM:
    engine_args = {"max_model_len": 512, "kv_cache_memory_gb": 0.1, **engine_args}
    return LLM(sparsity=SPARSITY, async_scheduling=async_scheduling, **engine_args)


@pytest.fixture(scope="module")
def llms() -> dict[bool, LLM]:
    return {flag: _llm(flag) for flag in (False, True)}


def _drive(engine: LLMEngine, arrivals: dict[int, list], aborts: dict[int, str]) -> dict:
    """Step until done; before step i add `arrivals[i]` (id, prompt, params) and abort
    `aborts[i]`. Returns every request's last output, and checks that no block is left."""
    engine.step_records = []
    last, i = {}, 0
    while engine.has_unfinished or i <= max([*arrivals, *aborts]):
        for request in arrivals.get(i, []):
            engine.add_request(*request)
        if i in aborts:
            aborted = engine.abort(aborts[i])
            last[aborted.request_id] = aborted
        last.update((out.request_id, out) for out in engine.step())
        i += 1
    engine.check_invariants()
    assert all(g["used"] == 0 for g in engine.block_manager.usage().values())
    return last


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for request_id in a:
        x, y = a[request_id], b[request_id]
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert (x.logprobs is None) == (y.logprobs is None)
        for u, v in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert (u.token_id, [t for t, _ in u.top]) == (v.token_id, [t for t, _ in v.top])
            assert [u.logprob, *(lp for _, lp in u.top)] == pytest.approx(
                [v.logprob, *(lp for _, lp in v.top)], abs=1e-4
            )


def test_stop_strings_eos_and_lengths_end_the_same(llms):
    greedy = SamplingParams(max_tokens=40, temperature=0)
    # A stop string from the middle of one answer, so that a step ahead computes past it.
    text = llms[False].generate([PROMPTS[1]], greedy)[0].text
    stop = text[len(text) // 3 :][:5]
    requests = [
        ("eos", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0)),
        ("stop", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, stop=[stop])),
        ("short", PROMPTS[2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
        ("long", PROMPTS[3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True,
                                            logprobs=3)),
        ("seeded", PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=5,
                                              presence_penalty=0.5, logprobs=0)),
    ]  # fmt: skip
    runs = {flag: _drive(llm.engine, {0: requests}, {}) for flag, llm in llms.items()}
    _same(runs[False], runs[True])
    assert runs[True]["stop"].finish_reason == "stop" and runs[True]["short"].token_ids
    ahead = [r.launched_ahead for r in llms[True].engine.step_records]
    assert sum(ahead) > len(ahead) / 2, "most decode steps were launched ahead"
    assert not any(r.launched_ahead for r in llms[False].engine.step_records)


def test_aborts_and_arrivals_while_a_step_is_in_flight(llms):
    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)

    arrivals = {
        0: [("a", PROMPTS[0], params(30)), ("b", PROMPTS[1], params(30))],
        4: [("c", PROMPTS[2], params(12))],
        9: [("d", PROMPTS[3], params(5))],
    }
    aborts = {6: "b", 11: "d"}
    runs = {flag: _drive(llm.engine, arrivals, aborts) for flag, llm in llms.items()}
    # The arrivals join steps launched ahead, their prompts beside the running decode rows.
    records = llms[True].engine.step_records
    assert any(r.launched_ahead and r.num_prefill_seqs and r.num_decode_seqs for r in records)
    # An abort cuts a request wherever it is, which differs between the two ways of stepping;
    # what it had produced must still be the start of its answer.
    for request_id, prompt, p in (request for i in (0, 9) for request in arrivals[i]):
        if request_id in aborts.values():
            whole = llms[False].generate([prompt], p)[0].token_ids
            for run in runs.values():
                cut = run.pop(request_id)
                assert cut.finish_reason == "abort" and cut.token_ids
                assert cut.token_ids == whole[: len(cut.token_ids)]
    _same(runs[False], runs[True])


def test_preemption_under_a_full_cache_gives_the_same_tokens():
    """A cache too small for every sequence: steps ahead never preempt, the others do."""
    prompts = [f"{p} Tell me more about it in detail." for p in PROMPTS] * 2
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    runs = {}
    for flag in (False, True):
        # 18 preemptions for 8 requests (with 3/4 of it, 21: it thrashes, one sequence
        # running at a time, and which one the two ways of stepping preempt may differ).
        llm = _llm(flag, kv_cache_memory_gb=0.008, max_model_len=256)
        requests = [(str(i), p, params) for i, p in enumerate(prompts)]
        runs[flag] = _drive(llm.engine, {0: requests}, {})
        assert llm.engine.scheduler.num_preemptions > 0
    _same(runs[False], runs[True])


def test_steps_go_ahead_while_prompts_wait_for_a_free_slot():
    """Prompts that cannot be admitted (max_num_seqs reached) do not stop the overlap, and every
    step's record counts what it ran when it was launched."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    requests = [(str(i), p, params) for i, p in enumerate(PROMPTS)]
    runs, records = {}, {}
    for flag in (False, True):
        engine = _llm(flag, max_num_seqs=2).engine
        runs[flag] = _drive(engine, {0: requests}, {})
        records[flag] = engine.step_records
    _same(runs[False], runs[True])
    waiting_ahead = [r for r in records[True] if r.launched_ahead]
    assert len(waiting_ahead) > len(records[True]) / 2
    prompt_tokens = sum(len(out.prompt_token_ids) for out in runs[True].values())
    for flag in (False, True):
        assert sum(r.num_prefill_tokens for r in records[flag]) == prompt_tokens
        assert sum(r.num_decode_seqs for r in records[flag]) == len(PROMPTS) * 11


def test_after_a_finish_a_step_goes_ahead_when_a_new_prompt_could_not_join_it():
    """Right after a step that finished a request the next step waits for the host (the
    request's client often sends its next one within a step), unless a new prompt could not
    join it anyway. Here at most two sequences run: each prompt behind the first two is
    admitted right after a finish, into the one free slot, so a new prompt would find none and
    every such step is launched ahead (the rule before counted only the waiting tokens)."""
    long_prompt = " ".join(PROMPTS) * 4
    runs, engines = {}, {}
    for flag in (False, True):
        engines[flag] = _llm(
            flag, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=2
        ).engine
        requests = [  # lengths that differ: one finish at a time
            (str(i), long_prompt, SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True))
            for i in range(6)
        ]  # fmt: skip
        runs[flag] = _drive(engines[flag], {0: requests}, {})
    _same(runs[False], runs[True])
    admitting = [r for r in engines[True].step_records[1:] if r.num_prefill_seqs]
    assert [r.launched_ahead for r in admitting] == [True] * 4


def test_a_new_prompt_joins_the_next_step_only_with_a_slot_and_room_left():
    """What `admits_another_prompt` weighs: the waiting prompts go first; a new prompt needs a
    sequence slot and room for all its tokens, or with chunked prefill for a chunk."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def scheduler(*waiting: int, **engine_args):
        engine = LLM("dummy:tiny", sparsity=SPARSITY, max_model_len=256, kv_cache_memory_gb=0.01,
                     **engine_args).engine  # fmt: skip
        for i, length in enumerate(waiting):
            engine.add_request(str(i), [5] * length, params)
        return engine.scheduler

    empty = scheduler(max_num_batched_tokens=256)
    assert empty.admits_another_prompt(256)
    assert empty.admits_another_prompt(4000)  # longer than any prompt: taken as a step's worth
    one = scheduler(100, max_num_batched_tokens=256)
    assert one.admits_another_prompt(156) and not one.admits_another_prompt(157)
    assert not scheduler(100, 156, max_num_batched_tokens=256).admits_another_prompt(1)
    assert not scheduler(10, 10, max_num_seqs=2).admits_another_prompt(10)  # no slot left
    chunked = scheduler(60, max_num_batched_tokens=64, enable_chunked_prefill=True)
    window = chunked.min_last_chunk
    assert chunked.admits_another_prompt(100)  # a first chunk of 4 tokens
    assert not chunked.admits_another_prompt(window)  # too short to split, too long for 4


def test_decode_eviction_rotates_the_same_tokens_with_steps_launched_ahead():
    """The ring's slot of a token fed in flight comes from the same count of tokens fed as a
    plain step's: 60 generated tokens go round a sparse group's ring (48 less the prompt)."""
    sparsity = SparsityConfig(**{**vars(SPARSITY), "decode_eviction": True, "decode_window": 8})
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    requests = [(str(i), p, params) for i, p in enumerate(PROMPTS)]
    runs, records = {}, {}
    for flag in (False, True):
        engine = LLM(sparsity=sparsity, async_scheduling=flag, max_model_len=512,
                     kv_cache_memory_gb=0.1).engine  # fmt: skip
        runs[flag] = _drive(engine, {0: requests}, {})
        records[flag] = engine.step_records
    _same(runs[False], runs[True])
    assert sum(r.launched_ahead for r in records[True]) > len(records[True]) / 2
    assert all(out.kv_tokens_held["budget48"] == 48 for out in runs[True].values())

"""The scheduler over a real block manager, driven with plain sequences (no model): admission
order and its limits (max_num_seqs, the step's prompt tokens, every group's blocks), preemption,
chunked prefill, space_admissions, and which step async scheduling launches ahead. The engine's
part is played by `run`: launch (what each row samples), account, read back one token a row."""

from __future__ import annotations

import torch

from sparse_core.cache.block_manager import BlockManager
from sparse_core.cache.retention import KVRetention
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.scheduler import ScheduledStep, Scheduler
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.sampling_params import SamplingParams
from sparse_core.sequence import Sequence, SequenceStatus

BLOCK = 16
DENSE = SparsityConfig(policy="dense")
# Two whole layers, two sparse: two KV groups of two layers.
SNAPKV = SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=2)


def scheduler(
    blocks: int | None = None,
    sparsity: SparsityConfig = DENSE,
    min_last_chunk: int = 1,
    **engine_args,
) -> Scheduler:
    """A scheduler over a BlockManager of `blocks` (64 a group if not given; dense: one group
    of every layer; SNAPKV: the whole layers, then the sparse ones), for the tiny model."""
    engine_args = {"max_model_len": 256, "max_num_seqs": 8, **engine_args}
    config = EngineConfig(block_size=BLOCK, **engine_args)
    retention = KVRetention.build(DUMMY_PRESETS["tiny"], config, sparsity, torch.float32)
    blocks = blocks or 64 * len(retention.groups)
    manager = BlockManager(retention, blocks, config.max_num_seqs, config.max_model_len)
    return Scheduler(config, manager, min_last_chunk)


def add(sched: Scheduler, *prompt_lens: int, **params) -> list[Sequence]:
    """Sequences with prompts of these lengths, waiting in this order."""
    num_groups = len(sched.block_manager.groups)
    seqs = []
    for length in prompt_lens:
        seq = Sequence(f"s{len(sched.waiting)}", [5] * length, SamplingParams(**params), num_groups)
        sched.add(seq)
        seqs.append(seq)
    return seqs


def read_back(sched: Scheduler, step: ScheduledStep, wanted: list[bool]) -> None:
    """The engine's part once a step's tokens are read: one token for every row that sampled
    one (not a chunk before the last), and a finish when it is the last by max_tokens."""
    for seq, sampled in zip(step.seqs, wanted, strict=True):
        if sampled and not seq.is_finished:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")


def run(sched: Scheduler) -> ScheduledStep:
    """One step stepped synchronously: schedule, launch, account, read back; the step."""
    step = sched.schedule()
    wanted = [seq.samples_next_token for seq in step.seqs]
    sched.step_done(step)
    read_back(sched, step, wanted)
    return step


def used(sched: Scheduler) -> list[int]:
    """Blocks each KV group uses."""
    manager = sched.block_manager
    return [manager.pool.num_used_by(g) for g in range(len(manager.groups))]


def check(sched: Scheduler) -> None:
    sched.block_manager.check_invariants(sched.running)


# -- admission --------------------------------------------------------------------------------


def test_as_many_sequences_run_at_once_as_max_num_seqs_allows():
    sched = scheduler(max_num_seqs=4)
    seqs = add(sched, *[20] * 10, max_tokens=50)
    step = run(sched)
    assert step.prefills == seqs[:4] and step.decodes == []
    assert [seq.num_scheduled_tokens for seq in step.prefills] == [20] * 4
    assert list(sched.waiting) == seqs[4:]
    for _ in range(3):  # no slot left: every step decodes the four, none joins
        step = run(sched)
        assert step.prefills == [] and step.decodes == seqs[:4]
    assert [len(seq.output_token_ids) for seq in seqs[:4]] == [4] * 4
    assert used(sched) == [4 * 2]  # 24 tokens: two blocks each
    check(sched)


def test_a_finish_frees_its_slot_and_blocks_for_the_next_waiting_prompt():
    sched = scheduler(max_num_seqs=2)
    short, long, waiting = add(sched, 20, 20, 40, max_tokens=2)
    long.params = SamplingParams(max_tokens=10)
    assert run(sched).prefills == [short, long]
    run(sched)  # short's second token: it finishes by length
    assert short.is_finished and short.finish_reason == "length"
    assert short.block_tables == [[]] and used(sched) == [2]
    step = run(sched)
    assert step.prefills == [waiting] and step.decodes == [long]
    assert sched.running == [long, waiting] and used(sched) == [2 + 3]
    check(sched)


def test_prompts_fill_the_step_token_budget_first_come_first_served():
    sched = scheduler(max_num_batched_tokens=256)
    seqs = add(sched, 100, 100, 100, 10)
    step = run(sched)
    # 100 + 100; the third does not fit the 56 tokens left, and the short one behind it waits.
    assert step.prefills == seqs[:2]
    step = run(sched)
    assert step.prefills == seqs[2:] and step.decodes == seqs[:2]
    assert sum(seq.num_scheduled_tokens for seq in step.prefills) == 110
    check(sched)


def test_kv_blocks_decide_how_many_prompts_are_admitted():
    sched = scheduler(blocks=20)
    seqs = add(sched, 100, 100, 100)  # 7 blocks each: two fit in 20
    assert sched.schedule().prefills == seqs[:2]
    assert used(sched) == [14] and list(sched.waiting) == seqs[2:]
    check(sched)


def test_the_sparse_group_holds_only_the_budget_of_the_pool_both_share():
    """A 100-token prompt takes 7 blocks in the whole group and 3 in the sparse one, which
    keeps 40 tokens: four of six fit in 40 blocks (two would, dense)."""
    sched = scheduler(blocks=40, sparsity=SNAPKV, min_last_chunk=8)
    seqs = add(sched, *[100] * 6)
    step = run(sched)
    assert step.prefills == seqs[:4]
    assert used(sched) == [28, 12]
    assert [seq.kv_lens for seq in seqs[:4]] == [[100, 40]] * 4
    check(sched)


# -- preemption -------------------------------------------------------------------------------


def test_a_full_group_preempts_the_newest_sequence_and_frees_its_blocks():
    sched = scheduler(blocks=7)
    a, b, c = add(sched, 32, 32, 32, max_tokens=50)  # two full blocks each: one block left
    run(sched)
    assert used(sched) == [6]
    # Each needs a new block for its 33rd token: a takes the last one, c is preempted so that
    # b gets one of its two.
    step = run(sched)
    assert step.decodes == [a, b] and step.prefills == []
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert c.status == SequenceStatus.WAITING and c.block_tables == [[]] and c.kv_lens == [0]
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert used(sched) == [6]
    # It is recomputed whole (prompt and its output so far) when three blocks are free.
    assert c.num_prefill_tokens == 33
    check(sched)


def test_a_sequence_alone_without_room_is_preempted_rather_than_waited_on():
    sched = scheduler(blocks=2)
    (seq,) = add(sched, 32, max_tokens=50)
    run(sched)
    step = sched.schedule()  # no block for its 33rd token, and no newer one to preempt
    assert not step and list(sched.waiting) == [seq] and used(sched) == [0]


# -- chunked prefill --------------------------------------------------------------------------


def test_chunked_prefill_splits_prompts_over_steps_of_the_token_budget():
    sched = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=64, min_last_chunk=8)
    add(sched, 100, 100)
    chunks: list[list[int]] = []
    sampled: list[list[bool]] = []
    while sched.has_work and len(chunks) < 5:
        step = sched.schedule()
        chunks.append([seq.num_scheduled_tokens for seq in step.prefills])
        sampled.append([seq.samples_next_token for seq in step.prefills])
        wanted = [seq.samples_next_token for seq in step.seqs]
        sched.step_done(step)
        read_back(sched, step, wanted)
    # a: 64, then 36; b takes the 28 left beside a's last chunk, then 64, then its last 8 (the
    # last chunk keeps at least min_last_chunk).
    assert chunks == [[64], [36, 28], [64], [8], []]
    assert sampled == [[False], [True, False], [False], [True], []]
    check(sched)


def test_the_last_chunk_keeps_the_observation_window():
    sched = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=64, min_last_chunk=8)
    (seq,) = add(sched, 70)
    assert run(sched).prefills == [seq] and seq.num_scheduled_tokens == 62
    assert run(sched).prefills == [seq] and seq.num_scheduled_tokens == 8


def test_a_chunked_prompt_holds_every_token_until_its_last_chunk():
    sched = scheduler(
        blocks=40,
        sparsity=SNAPKV,
        min_last_chunk=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
    )
    (seq,) = add(sched, 100)
    run(sched)
    assert seq.kv_lens == [100, 100] and used(sched) == [7, 7]
    run(sched)  # the last chunk: the sparse group shrinks to its 40 kept tokens
    assert seq.kv_lens == [100, 40] and used(sched) == [7, 3]
    check(sched)


# -- space_admissions -------------------------------------------------------------------------


def test_space_admissions_admits_none_right_after_a_prefill_that_starts_decoding():
    patterns = {}
    for spaced in (False, True):
        sched = scheduler(space_admissions=spaced)
        add(sched, 20, max_tokens=10)
        run(sched)
        add(sched, 20, 20, max_tokens=10)
        assert sched.admits_another_prompt(20) is not spaced
        steps = [run(sched) for _ in range(3)]
        patterns[spaced] = [len(step.prefills) for step in steps]
    assert patterns == {False: [2, 0, 0], True: [0, 2, 0]}


# -- launching ahead --------------------------------------------------------------------------


def launch(sched: Scheduler) -> tuple[ScheduledStep, list[bool]]:
    """Schedule a step and account it, as the engine does before it reads the step's tokens."""
    step = sched.schedule()
    wanted = [seq.samples_next_token for seq in step.seqs]
    sched.step_done(step)
    return step, wanted


def test_ahead_the_decode_rows_take_the_tokens_in_flight_beside_new_prompts():
    sched = scheduler()
    a, b = add(sched, 20, 20, max_tokens=10)
    run(sched)
    c = add(sched, 30, max_tokens=10)[0]
    in_flight, wanted = launch(sched)  # c's prefill, a and b decoding
    assert in_flight.seqs == [c, a, b]
    d = add(sched, 40, max_tokens=10)[0]
    ahead = sched.schedule_ahead(in_flight, wanted)
    assert ahead is not None
    assert ahead.prefills == [d] and ahead.decodes == [a, b, c]
    # Each decode row is fed the token in flight (from the device token pool), and samples.
    assert [seq.input_in_flight for seq in ahead.seqs] == [False, True, True, True]
    assert all(seq.samples_next_token for seq in ahead.seqs)
    # Their next slots are reserved already, before the tokens in flight are appended.
    assert [seq.kv_lens for seq in (a, b, c)] == [[22], [22], [31]]
    assert [seq.num_scheduled_tokens for seq in ahead.seqs] == [40, 1, 1, 1]
    check(sched)


def test_ahead_leaves_out_a_sequence_whose_token_in_flight_is_its_last():
    sched = scheduler()
    _, other = add(sched, 20, 20, max_tokens=2)
    other.params = SamplingParams(max_tokens=10)
    run(sched)
    in_flight, wanted = launch(sched)
    ahead = sched.schedule_ahead(in_flight, wanted)
    assert ahead is not None and ahead.decodes == [other] and other.input_in_flight


def test_nothing_goes_ahead_while_a_prompt_is_prefilled_in_chunks():
    sched = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=64, min_last_chunk=8)
    add(sched, 20, max_tokens=10)
    run(sched)
    add(sched, 100, max_tokens=10)
    in_flight, wanted = launch(sched)  # the long prompt's first chunk samples nothing
    assert wanted == [False, True]
    assert sched.schedule_ahead(in_flight, wanted) is None
    # Even with every row sampling, a prompt still prefilling stops it.
    assert sched.schedule_ahead(in_flight, [True, True]) is None


def test_nothing_goes_ahead_that_would_preempt_and_nothing_changes():
    sched = scheduler(blocks=4)
    a, b = add(sched, 31, 31, max_tokens=10)
    run(sched)
    in_flight, wanted = launch(sched)  # 32 tokens each: two full blocks, and none free
    kv_lens = [list(seq.kv_lens) for seq in (a, b)]
    assert sched.schedule_ahead(in_flight, wanted) is None
    assert [seq.kv_lens for seq in (a, b)] == kv_lens and used(sched) == [4]
    check(sched)


def test_right_after_a_finish_nothing_goes_ahead_while_a_new_prompt_could_join():
    """A request that finished lets its client's next one in: the next step waits for it,
    unless no prompt of expected_input_len could join that step anyway. An abort does not."""

    def after_a_finish(reason: str, **engine_args) -> bool:
        sched = scheduler(expected_input_len=50, **engine_args)
        ending, _ = add(sched, 20, 20, max_tokens=10)
        run(sched)
        sched.finish(ending, reason)
        add(sched, 20, max_tokens=10)  # takes the freed slot
        in_flight, wanted = launch(sched)
        return sched.schedule_ahead(in_flight, wanted) is not None

    assert not after_a_finish("stop")
    assert after_a_finish("stop", max_num_seqs=2)  # no slot for another prompt
    assert after_a_finish("abort")


def test_async_stepping_goes_ahead_but_right_after_a_finish():
    """A whole run stepped as the engine does with async scheduling: every step is launched
    ahead of the one in flight except the one right after c finishes (a new prompt could join
    it), and no step overruns a sequence's max_tokens."""
    sched = scheduler()
    a, b, c = add(sched, 20, 30, 40, max_tokens=6)
    c.params = SamplingParams(max_tokens=3)
    step, wanted = launch(sched)
    launched_ahead = []
    while True:
        ahead = sched.schedule_ahead(step, wanted)
        read_back(sched, step, wanted)
        if ahead is not None:
            step = ahead
            wanted = [seq.samples_next_token for seq in step.seqs]
            sched.step_done(step)
        elif sched.has_work:
            step, wanted = launch(sched)
        else:
            break
        launched_ahead.append(ahead is not None)
    assert [len(seq.output_token_ids) for seq in (a, b, c)] == [6, 6, 3]
    assert launched_ahead == [True, True, True, False, True]
    assert used(sched) == [0]

"""The block manager driven with plain sequences: admission, the shrink after prefill, decode
growth and freeing, for a whole group and a sparse one sharing one pool; and the prefix cache's
blocks: cached, shared, counted as free, evicted least recently used."""

from __future__ import annotations

import pytest
import torch

from sparse_core.cache.block_manager import BlockManager
from sparse_core.cache.retention import KVRetention
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.sampling_params import SamplingParams
from sparse_core.sequence import Sequence

BLOCK = 16
BLOCKS = 46  # the pool both groups share
# Two whole layers and two sparse ones of the tiny model: two KV groups of two layers.
SPARSITY = SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=2)
# The same with decode eviction: the prefill keeps 32 of the budget, 8 recent tokens rotate.
EVICTING = SparsityConfig(**{**vars(SPARSITY), "decode_eviction": True, "decode_window": 8})


def manager(
    caching: bool = False, blocks: int = BLOCKS, sparsity: SparsityConfig = SPARSITY
) -> BlockManager:
    retention = KVRetention.build(
        DUMMY_PRESETS["tiny"], EngineConfig(block_size=BLOCK), sparsity, torch.float32
    )
    assert [g.group.layers for g in retention.groups] == [(0, 1), (2, 3)]
    return BlockManager(retention, blocks, max_num_seqs=4, max_model_len=512,
                        enable_prefix_caching=caching, min_uncached_tokens=8)  # fmt: skip


def sequence(name: str, prompt_len: int, **params) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(**params), 2)


def used(bm: BlockManager) -> list[int]:
    """Blocks each group uses."""
    return [bm.pool.num_used_by(g) for g in range(2)]


def cached(bm: BlockManager) -> list[int]:
    """Blocks each group has in the cache."""
    return [bm.pool.num_cached_by(g) for g in range(2)]


def decode(bm: BlockManager, seq: Sequence, steps: int) -> None:
    """Decode steps as the scheduler runs them: room for the token, then it is computed."""
    for _ in range(steps):
        assert bm.can_append(seq)
        bm.append_slot(seq)
        seq.num_computed_tokens += 1


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """A whole prefill, admitted and run."""
    seq.start_prefill(bm.allocate(bm.admission(seq)))
    seq.num_computed_tokens = seq.prefill_len
    bm.end_prefill(seq)


def test_a_whole_prefill_takes_only_the_kept_blocks_in_a_sparse_group():
    bm = manager()
    seq = sequence("a", 100)
    assert bm.admission(seq).fits
    seq.start_prefill(bm.allocate(bm.admission(seq)))
    assert seq.kv_lens == [100, 40] and used(bm) == [7, 3]
    assert seq.prompt_kv_lens == [100, 40]
    bm.end_prefill(seq)  # nothing to give back: it held no more
    assert seq.kv_lens == [100, 40] and used(bm) == [7, 3]
    bm.check_invariants([seq])


def test_a_chunked_prefill_holds_every_token_until_it_ends_then_shrinks_to_the_budget():
    bm = manager()
    seq = sequence("a", 100)
    seq.start_prefill(bm.allocate(bm.admission(seq, chunked=True)))
    assert seq.kv_lens == [100, 100] and used(bm) == [7, 7]
    bm.end_prefill(seq)
    assert seq.kv_lens == [100, 40] and used(bm) == [7, 3]
    assert seq.block_tables[1] == seq.block_tables[1][:3]
    bm.check_invariants([seq])


def test_decode_tokens_take_a_new_block_only_where_the_last_one_is_full():
    bm = manager()
    seq = sequence("a", 100)
    prefill(bm, seq)
    decode(bm, seq, 8)  # whole: 100 -> 108 (block 7 full at 112); sparse: 40 -> 48 (full at 48)
    assert seq.kv_lens == [108, 48] and used(bm) == [7, 3]
    bm.append_slot(seq)  # the next step's token
    assert seq.kv_lens == [109, 49] and used(bm) == [7, 4]
    # Slots are where the token goes: block * size + offset, in each group's own blocks.
    slots = bm.batch_slots([seq], bm.batch_tables([seq]), torch.tensor([seq.kv_lens]).T)
    assert slots.tolist() == [
        [seq.block_tables[0][6] * BLOCK + 12],
        [seq.block_tables[1][3] * BLOCK],
    ]
    bm.check_invariants([seq])


def test_decode_eviction_holds_a_sparse_group_at_its_budget_and_rotates_the_recent_tokens():
    bm = manager(sparsity=EVICTING)
    seq = sequence("a", 100)
    prefill(bm, seq)
    assert seq.kv_lens == [100, 32] and seq.decode_rings == [(100, 0, 0), (32, 8, 0)]
    decode(bm, seq, 8)  # the ring fills: 32 -> 40 held, in 3 blocks
    assert seq.kv_lens == [108, 40] and used(bm) == [7, 3]
    decode(bm, seq, 300)  # the whole group grows; the sparse one stays at its budget
    assert seq.kv_lens == [408, 40] and used(bm) == [26, 3]
    bm.append_slot(seq)  # the 309th token after the prefill replaces the ring's oldest
    slots = bm.batch_slots([seq], bm.batch_tables([seq]), torch.tensor([seq.kv_lens]).T)
    index = 32 + 308 % 8
    assert slots.tolist() == [
        [seq.block_tables[0][408 // BLOCK] * BLOCK + 408 % BLOCK],
        [seq.block_tables[1][index // BLOCK] * BLOCK + index % BLOCK],
    ]
    assert seq.kv_lens == [409, 40]
    bm.check_invariants([seq])
    bm.free(seq)
    assert used(bm) == [0, 0]


def test_decode_eviction_after_a_short_prompt_appends_up_to_the_budget_first():
    bm = manager(sparsity=EVICTING)
    seq = sequence("a", 20)  # under the budget less the window: kept whole, then 20 appended
    prefill(bm, seq)
    assert seq.kv_lens == [20, 20] and seq.decode_rings == [(20, 0, 0), (20, 20, 0)]
    decode(bm, seq, 50)
    assert seq.kv_lens == [70, 40]
    bm.check_invariants([seq])


def test_freeing_every_sequence_gives_the_pool_back_whole():
    bm = manager()
    seqs = [sequence(name, n) for name, n in (("a", 100), ("b", 30), ("c", 250))]
    for i, seq in enumerate(seqs):
        seq.start_prefill(bm.allocate(bm.admission(seq, chunked=i == 0)))
        bm.end_prefill(seq)
        decode(bm, seq, 20)
    assert used(bm) == [8 + 4 + 17, 4 + 4 + 4]  # every sparse block in use
    bm.check_invariants(seqs)
    for seq in seqs:
        bm.free(seq)
        assert seq.block_tables == [[], []] and seq.kv_lens == [0, 0]
    assert used(bm) == [0, 0]
    assert bm.pool.num_free == BLOCKS
    bm.check_invariants([])


def test_admission_is_refused_when_the_pool_lacks_the_blocks_of_every_group():
    bm = manager()
    first = sequence("a", 300)  # 19 blocks in the whole group, 3 in the sparse one
    first.start_prefill(bm.allocate(bm.admission(first)))
    assert bm.admission(sequence("b", 300)).fits  # 22 + 22 <= 46
    assert not bm.admission(sequence("b", 400)).fits  # 22 + 25 + 3 > 46
    # Chunked, the sparse group holds the whole prefill: 22 + 19 + 19 > 46.
    assert not bm.admission(sequence("b", 300), chunked=True).fits


def test_an_admission_made_before_the_pool_changed_is_not_allocated():
    """An Admission holds within one scheduling decision: once another sequence took or gave
    back blocks, allocating it fails instead of taking blocks it no longer fits."""
    bm = manager()
    first, second = sequence("a", 100), sequence("b", 100)
    stale = bm.admission(second)
    prefill(bm, first)
    with pytest.raises(AssertionError, match="stale admission"):
        bm.allocate(stale)
    bm.allocate(bm.admission(second))


def test_forced_prompt_tokens_after_a_compressed_prefix_count_as_kept():
    bm = manager()
    seq = sequence("a", 120, compress_prefix_len=100)
    seq.start_prefill(bm.allocate(bm.admission(seq)))
    assert seq.kv_lens == [100, 40]
    assert seq.prompt_kv_lens == [120, 60]  # the 20 forced prompt tokens are kept whole


def prefilled(bm: BlockManager, seq: Sequence) -> Sequence:
    seq.start_prefill(bm.allocate(bm.admission(seq)))
    seq.num_computed_tokens = seq.prefill_len  # the prefill ran
    bm.end_prefill(seq)
    return seq


def test_a_prefill_that_caches_keeps_its_full_blocks_and_a_hit_starts_after_them():
    bm = manager(caching=True)
    first = sequence("a", 100)
    first.start_prefill(bm.allocate(bm.admission(first)))
    # Every prefill token in both groups (7 blocks), and the sparse group's kept 40 in 3 more.
    assert first.caches_prefill and first.kv_lens == [100, 100] and used(bm) == [7, 10]
    first.num_computed_tokens = 100
    bm.end_prefill(first)
    # Its 6 full blocks stay cached in the sparse group; the whole group still uses them.
    assert used(bm) == [7, 3] and cached(bm) == [0, 6]
    # 90 tokens: its 5 full blocks before the 8-token window are cached; it takes 1 more block
    # and 3 for its kept tokens in the sparse group.
    second = sequence("b", 90)
    assert bm.admission(second).num_cached_tokens == 80
    second.start_prefill(bm.allocate(bm.admission(second)))
    assert second.num_computed_tokens == 80 and second.num_cached_tokens == 80
    assert second.block_tables[0][:5] == first.block_tables[0][:5]  # shared in the whole group
    assert bm.pool.refs(first.block_tables[0][0]) == 2
    bm.check_invariants([first, second])
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (190, 80)


def ids(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_cached_blocks_count_as_free_and_leave_unproven_first_least_recently_used_first():
    """A prefix found again (proven) outlives newer ones never found; a miss does not evict a
    cached prefix to cache its own (it runs as without the cache)."""
    bm = manager(caching=True, blocks=30)
    b = prefilled(bm, Sequence("b", ids(500, 64), SamplingParams(), 2))
    bm.free(b)
    assert bm.pool.num_free == 30  # cached blocks count as free
    idle_admissions(bm, 9)  # b is found again 10 admissions later: nothing expires below 20
    # b's 4 full blocks found again: proven. Its fifth (tokens 64-79) is new, unproven.
    bm.free(prefilled(bm, Sequence("b2", ids(500, 80), SamplingParams(), 2)))
    a = prefilled(bm, Sequence("a", ids(1, 64), SamplingParams(), 2))
    bm.free(a)  # newer than b's, never found again
    assert cached(bm) == [9, 9]
    assert bm.pool.has_room_for_new_prefix(12) and not bm.pool.has_room_for_new_prefix(13)
    # Two misses of 100 tokens: caching would need 17 blocks where 12 hold no prefix, so both
    # run without the cache, taking 10 blocks each: the second evicts 8 cached blocks, never
    # found: b2's fifth in both groups, then a's, the sparse group's first (released when its
    # prefill ended), each prefix's tail before its head.
    c, d = (Sequence(n, ids(900 + 200 * i, 100), SamplingParams(), 2) for i, n in enumerate("cd"))
    for seq in (c, d):
        seq.start_prefill(bm.allocate(bm.admission(seq)))
        assert not seq.caches_prefill
    assert sum(cached(bm)) == 10
    lookups = {"b": ids(500, 64), "a": ids(1, 64), "b2": ids(500, 80)}
    found = {name: [len(blocks) for blocks in bm.cached_blocks(Sequence(name, tokens,
             SamplingParams(), 2))] for name, tokens in lookups.items()}  # fmt: skip
    assert found == {"b": [3, 3], "a": [0, 0], "b2": [4, 4]}
    bm.check_invariants([c, d])


def idle_admissions(bm: BlockManager, count: int) -> None:
    """Admissions of prompts shorter than a block (nothing cached, nothing found)."""
    for i in range(count):
        bm.free(prefilled(bm, Sequence(f"x{i}", ids(90_000 + 10 * i, 8), SamplingParams(), 2)))


def conversation_turns(bm: BlockManager, bases: list[list[int]], turns: int) -> list[list[int]]:
    """Conversations taking turns, each turn its base and 16 more tokens per turn; the tokens
    every turn found cached, by turn and conversation."""
    hits: list[list[int]] = []
    for turn in range(turns):
        hits.append([])
        for c, base in enumerate(bases):
            seq = Sequence(f"c{c}t{turn}", base + ids(50_000 + turn, 16 * turn),
                           SamplingParams(), 2)  # fmt: skip
            prefilled(bm, seq)
            hits[-1].append(seq.num_cached_tokens)
            bm.free(seq)
            bm.check_invariants([])
    return hits


def test_conversations_beyond_the_caches_room_keep_the_first_ones_hitting():
    """Six conversations take turns, each turn its previous prompt and 16 more tokens, with
    room in the pool (34 blocks) to cache about three of them. Least-recently-used eviction
    alone would have every turn evict the prefix asked for next (no hit ever); here the three
    conversations cached first hit at every later turn, the others run uncached."""
    bm = manager(caching=True, blocks=34)
    hits = conversation_turns(bm, [ids(1000 * (c + 1), 64) for c in range(6)], 4)
    assert hits[0] == [0] * 6
    for turn in (1, 2, 3):
        assert min(hits[turn][:3]) >= 48 and hits[turn][3:] == [0] * 3, hits


def test_a_prefix_no_longer_asked_for_expires_and_new_conversations_take_its_room():
    """Two conversations fill the cache and end; two new ones start. While the old prefixes
    are younger than twice their reuse interval the new ones run uncached; then the old ones
    expire, and a new one (the room holds one at these lengths) is cached and hits at every
    later turn (without expiry, none ever would)."""
    bm = manager(caching=True, blocks=34)
    first = conversation_turns(bm, [ids(1000, 64), ids(2000, 64)], 4)
    assert all(min(turn) >= 32 for turn in first[1:])
    later = conversation_turns(bm, [ids(3000, 64), ids(4000, 64)], 6)
    assert later[0] == [0, 0]
    assert all(max(turn) >= 64 for turn in later[-3:]), later


def test_a_prefill_without_room_to_cache_runs_as_without_the_cache():
    bm = manager(caching=True, blocks=20)
    big = sequence("a", 150)  # caching needs 10 + 10 + 3 blocks of 20: no room
    assert bm.admission(big).fits
    big.start_prefill(bm.allocate(bm.admission(big)))
    assert not big.caches_prefill and big.kv_lens == [150, 40] and used(bm) == [10, 3]
    big.num_computed_tokens = 150
    bm.end_prefill(big)
    assert cached(bm) == [0, 0]
    bm.check_invariants([big])


def test_clearing_the_cache_frees_every_cached_block():
    bm = manager(caching=True)
    bm.free(prefilled(bm, sequence("a", 100)))
    bm.clear_prefix_cache()
    assert cached(bm) == [0, 0]
    assert bm.admission(sequence("b", 100)).num_cached_tokens == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    bm.pool.check()

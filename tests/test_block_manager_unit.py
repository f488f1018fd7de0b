"""The block manager driven with plain sequences: admission, the shrink after prefill, decode
growth and freeing, for a whole group and a sparse one."""

from __future__ import annotations

import torch

from sparse_core.cache.block_manager import BlockManager
from sparse_core.cache.retention import KVRetention
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.sampling_params import SamplingParams
from sparse_core.engine.sequence import Sequence
from sparse_core.models.config import DUMMY_PRESETS

BLOCK = 16
BLOCKS = [40, 12]  # whole group, sparse group
SPARSITY = SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=1)


def manager() -> BlockManager:
    retention = KVRetention.build(
        DUMMY_PRESETS["tiny"], EngineConfig(block_size=BLOCK), SPARSITY, torch.float32
    )
    return BlockManager(retention, BLOCKS, max_num_seqs=4, max_model_len=512)


def sequence(name: str, prompt_len: int, **params) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(**params), 2)


def used(bm: BlockManager) -> list[int]:
    return [pool.num_used for pool in bm.pools]


def decode(bm: BlockManager, seq: Sequence, steps: int) -> None:
    for _ in range(steps):
        assert bm.can_append(seq)
        seq.decode_slots = bm.append_slots(seq)


def test_a_whole_prefill_takes_only_the_kept_blocks_in_a_sparse_group():
    bm = manager()
    seq = sequence("a", 100)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert seq.kv_lens == [100, 40] and used(bm) == [7, 3]
    assert seq.prompt_kv_lens == [100, 40]
    bm.end_prefill(seq)  # nothing to give back: it held no more
    assert seq.kv_lens == [100, 40] and used(bm) == [7, 3]
    bm.check_invariants([seq])


def test_a_chunked_prefill_holds_every_token_until_it_ends_then_shrinks_to_the_budget():
    bm = manager()
    seq = sequence("a", 100)
    bm.allocate(seq, chunked=True)
    assert seq.kv_lens == [100, 100] and used(bm) == [7, 7]
    bm.end_prefill(seq)
    assert seq.kv_lens == [100, 40] and used(bm) == [7, 3]
    assert seq.block_tables[1] == seq.block_tables[1][:3]
    bm.check_invariants([seq])


def test_decode_tokens_take_a_new_block_only_where_the_last_one_is_full():
    bm = manager()
    seq = sequence("a", 100)
    bm.allocate(seq)
    bm.end_prefill(seq)
    decode(bm, seq, 8)  # whole: 100 -> 108 (block 7 full at 112); sparse: 40 -> 48 (full at 48)
    assert seq.kv_lens == [108, 48] and used(bm) == [7, 3]
    decode(bm, seq, 1)
    assert seq.kv_lens == [109, 49] and used(bm) == [7, 4]
    # Slots are where the token goes: block * size + offset, in each group's own blocks.
    assert seq.decode_slots == [seq.block_tables[0][6] * BLOCK + 12, seq.block_tables[1][3] * BLOCK]
    bm.check_invariants([seq])


def test_freeing_every_sequence_gives_every_pool_back_whole():
    bm = manager()
    seqs = [sequence(name, n) for name, n in (("a", 100), ("b", 30), ("c", 250))]
    for i, seq in enumerate(seqs):
        bm.allocate(seq, chunked=i == 0)
        bm.end_prefill(seq)
        decode(bm, seq, 20)
    assert used(bm) == [8 + 4 + 17, 4 + 4 + 4]  # every sparse block in use
    bm.check_invariants(seqs)
    for seq in seqs:
        bm.free(seq)
        assert seq.block_tables == [[], []] and seq.kv_lens == [0, 0]
    assert used(bm) == [0, 0]
    assert [pool.num_free for pool in bm.pools] == BLOCKS
    bm.check_invariants([])


def test_admission_is_refused_when_one_group_lacks_the_blocks():
    bm = manager()
    first = sequence("a", 300)  # whole group: 19 of 40 blocks; sparse: 3 of 12
    bm.allocate(first)
    assert bm.can_allocate(sequence("b", 300))  # 19 + 19 <= 40
    assert not bm.can_allocate(sequence("b", 400))  # 19 + 25 > 40
    # Chunked, the sparse group must hold the whole prefill: 3 + 19 > 12.
    assert not bm.can_allocate(sequence("b", 300), chunked=True)


def test_forced_prompt_tokens_after_a_compressed_prefix_count_as_kept():
    bm = manager()
    seq = sequence("a", 120, compress_prefix_len=100)
    bm.allocate(seq)
    assert seq.kv_lens == [100, 40]
    assert seq.prompt_kv_lens == [120, 60]  # the 20 forced prompt tokens are kept whole

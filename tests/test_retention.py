"""What a KV group's cache holds of a sequence (KVRetention), and the shared block it sizes."""

from __future__ import annotations

import pytest
import torch

from sparse_core.cache.retention import GroupRetention, KVRetention, layers_per_block
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.policy import LayerGroup

TINY = DUMMY_PRESETS["tiny"]  # 4 layers, 2 KV heads of 16 dims
SPARSE = SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=1)


def retention(
    sparsity: SparsityConfig = SPARSE, dtype: torch.dtype = torch.bfloat16, **engine
) -> KVRetention:
    return KVRetention.build(TINY, EngineConfig(block_size=16, **engine), sparsity, dtype)


def test_a_whole_group_holds_every_token_at_every_stage():
    whole = retention().groups[0]
    assert whole.group.budget is None and whole.group.layers == (0,)
    assert whole.tokens_at_admission(100) == whole.tokens_at_admission(100, chunked=True) == 100
    assert whole.tokens_after_prefill(100, 7) == 107
    assert whole.peak_tokens(100, 20) == 120
    assert not whole.compresses(100)
    assert whole.blocks(whole.peak_tokens(100, 20)) == 8  # 120 tokens in blocks of 16


def test_a_sparse_group_holds_its_budget_after_prefill_and_the_whole_prefill_in_chunks():
    sparse = retention().groups[1]
    assert sparse.group.budget == 40 and sparse.group.layers == (1,)
    assert sparse.tokens_at_admission(100) == 40  # compressed as it is written
    assert sparse.tokens_at_admission(100, chunked=True) == 100  # the last chunk scores them all
    assert sparse.tokens_after_prefill(100) == 40
    assert sparse.tokens_after_prefill(100, 5) == 45
    assert sparse.tokens_after_prefill(30, 5) == 35  # a prompt under the budget is kept whole
    assert sparse.compresses(41) and not sparse.compresses(40)
    assert sparse.peak_tokens(100, 20) == 60
    assert sparse.peak_tokens(100, 20, chunked_prefill_tokens=100) == 100
    assert sparse.blocks(sparse.tokens_after_prefill(100)) == 3


def test_a_block_holds_as_many_layers_as_the_smallest_group_with_little_padding():
    # 1 whole layer and 3 sparse ones: blocks of one layer, four KV groups.
    r = retention()
    assert r.layers_per_block == 1
    assert [(g.group.name, g.group.layers) for g in r.groups] == [
        ("full", (0,)), ("budget40", (1,)), ("budget40", (2,)), ("budget40", (3,))
    ]  # fmt: skip
    assert r.plan.layer_to_group == (0, 1, 2, 3) and r.plan.full_layers == [0]
    # 2 and 2: two groups of two layers.
    two = retention(SparsityConfig(policy="snapkv", budget=40, full_layers=2))
    assert two.layers_per_block == 2 and [g.group.layers for g in two.groups] == [(0, 1), (2, 3)]
    # The Llama-3-8B shape: 3 whole layers and 29 sparse ones in 11 KV groups of 3 (the last
    # sparse one of 2); 10 and 22 in 16 of 2; a group of 1 makes every block one layer.
    assert layers_per_block([3, 29]) == 3
    assert layers_per_block([10, 22]) == 2
    assert layers_per_block([1, 31]) == 1
    assert layers_per_block([32]) == 32


def test_a_blocks_bytes_follow_the_kv_dtype_its_layers_and_the_ranks_heads():
    bf16 = retention()
    assert bf16.kv_dtype == torch.bfloat16
    assert bf16.bytes_per_token_per_layer == 2 * 2 * 16 * 2  # K and V, 2 heads, 16 dims, 2 bytes
    assert bf16.block_bytes == 128 * 16  # one layer of 16 tokens
    fp8 = retention(kv_cache_dtype="fp8")
    assert fp8.kv_dtype == torch.float8_e4m3fn and fp8.block_bytes == 64 * 16
    dense = retention(SparsityConfig(policy="dense"))
    assert dense.layers_per_block == 4 and dense.block_bytes == 4 * 128 * 16
    assert retention(tensor_parallel_size=2).bytes_per_token_per_layer == 64  # one head a rank
    assert retention(dtype=torch.float32, kv_cache_dtype="fp8").bytes_per_token_per_layer == 64


def test_a_dense_config_has_one_whole_group_of_every_layer():
    (whole,) = retention(SparsityConfig(policy="dense")).groups
    assert whole.group.layers == (0, 1, 2, 3) and whole.tokens_after_prefill(500) == 500


def test_the_cache_is_cut_into_blocks_every_group_shares_and_refused_below_two_a_group():
    r = retention()
    assert r.num_blocks(2**20) == 2**20 // (128 * 16)
    with pytest.raises(ValueError, match=r"too small.*4 KV groups.*\['budget40', 'full'\]"):
        r.num_blocks(7 * 128 * 16)
    assert r.num_blocks(8 * 128 * 16) == 8


def test_decode_eviction_bounds_a_sparse_group_at_its_budget():
    evicting = SparsityConfig(**{**vars(SPARSE), "decode_eviction": True, "decode_window": 16})
    sparse = retention(evicting).groups[1]
    assert sparse.tokens_after_prefill(100) == 24  # the budget less the window
    assert sparse.tokens_after_prefill(100, 5) == 29
    assert sparse.tokens_after_prefill(100, 300) == 40  # never more than the budget
    assert sparse.decode_ring(100) == (24, 16, 0)
    assert sparse.decode_ring(10) == (10, 30, 0)  # a short prompt whole, its ring the rest
    assert sparse.peak_tokens(100, 300) == 40
    # The window leaves the prompt its window, its sinks (8 + 2) and one scored token.
    narrow = SparsityConfig(**{**vars(evicting), "decode_window": 100})
    assert retention(narrow).groups[1].decode_ring(100) == (11, 29, 0)


def test_with_decode_eviction_a_ratio_budget_peaks_at_the_longest_prefill():
    """A preempted sequence prefills its outputs too, and a ratio budget grows with the prefill:
    its peak is the longest prefill's budget, not the prompt's."""
    group = LayerGroup("ratio4", (1,), ratio=4.0, floor=11, decode_window=16)
    ratio = GroupRetention(group, block_size=16)
    assert ratio.tokens_after_prefill(64, 960) == 16  # ceil(64 / 4)
    assert ratio.peak_tokens(64, 960) == 16
    assert ratio.peak_tokens(64, 960, longest_prefill_tokens=1023) == 256  # ceil(1023 / 4)

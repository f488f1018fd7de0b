"""What a layer group's cache holds of a sequence (KVRetention), and the memory split it drives."""

from __future__ import annotations

import pytest
import torch

from sparse_core.cache.memory import split_kv_memory
from sparse_core.cache.retention import KVRetention
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.models.config import DUMMY_PRESETS

TINY = DUMMY_PRESETS["tiny"]  # 4 layers, 2 KV heads of 16 dims
SPARSE = SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=1)


def retention(
    sparsity: SparsityConfig = SPARSE, dtype: torch.dtype = torch.bfloat16, **engine
) -> KVRetention:
    return KVRetention.build(TINY, EngineConfig(block_size=16, **engine), sparsity, dtype)


def test_a_whole_group_holds_every_token_at_every_stage():
    (whole, _) = retention().groups
    assert whole.group.budget is None and whole.group.layers == (0,)
    assert whole.tokens_at_admission(100) == whole.tokens_at_admission(100, chunked=True) == 100
    assert whole.tokens_after_prefill(100, 7) == 107
    assert whole.peak_tokens(100, 20) == 120
    assert not whole.compresses(100)
    assert whole.blocks(whole.peak_tokens(100, 20)) == 8  # 120 tokens in blocks of 16


def test_a_sparse_group_holds_its_budget_after_prefill_and_the_whole_prefill_in_chunks():
    (_, sparse) = retention().groups
    assert sparse.group.budget == 40 and sparse.group.layers == (1, 2, 3)
    assert sparse.tokens_at_admission(100) == 40  # compressed as it is written
    assert sparse.tokens_at_admission(100, chunked=True) == 100  # the last chunk scores them all
    assert sparse.tokens_after_prefill(100) == 40
    assert sparse.tokens_after_prefill(100, 5) == 45
    assert sparse.tokens_after_prefill(30, 5) == 35  # a prompt under the budget is kept whole
    assert sparse.compresses(41) and not sparse.compresses(40)
    assert sparse.peak_tokens(100, 20) == 60
    assert sparse.peak_tokens(100, 20, chunked_prefill_tokens=100) == 100
    assert sparse.blocks(sparse.tokens_after_prefill(100)) == 3


def test_bytes_per_token_follow_the_kv_dtype_the_layers_and_the_ranks_heads():
    bf16 = retention()
    assert bf16.kv_dtype == torch.bfloat16
    assert bf16.bytes_per_token_per_layer == 2 * 2 * 16 * 2  # K and V, 2 heads, 16 dims, 2 bytes
    assert [g.bytes_per_token for g in bf16.groups] == [128, 3 * 128]
    assert [g.block_bytes for g in bf16.groups] == [128 * 16, 3 * 128 * 16]
    fp8 = retention(kv_cache_dtype="fp8")
    assert fp8.kv_dtype == torch.float8_e4m3fn
    assert [g.bytes_per_token for g in fp8.groups] == [64, 3 * 64]
    assert retention(tensor_parallel_size=2).bytes_per_token_per_layer == 64  # one head a rank
    assert retention(dtype=torch.float32, kv_cache_dtype="fp8").bytes_per_token_per_layer == 64


def test_a_dense_config_has_one_whole_group_of_every_layer():
    (whole,) = retention(SparsityConfig(policy="dense")).groups
    assert whole.group.layers == (0, 1, 2, 3) and whole.tokens_after_prefill(500) == 500


def test_the_memory_split_fills_every_group_at_the_same_number_of_typical_requests():
    r = retention()
    total = 2**22
    blocks = split_kv_memory(r, total, expected_input_len=1000, expected_output_len=100)
    # A typical request holds 1100 tokens in the whole group and 140 in the sparse one.
    typical = [g.blocks(g.tokens_after_prefill(1000, 100)) for g in r.groups]
    fits = [b / t for b, t in zip(blocks, typical, strict=True)]
    assert max(fits) / min(fits) < 1.05, (blocks, typical)
    assert sum(b * g.block_bytes for b, g in zip(blocks, r.groups, strict=True)) <= total
    fp8 = split_kv_memory(retention(kv_cache_dtype="fp8"), total, 1000, 100)
    assert [f / b for f, b in zip(fp8, blocks, strict=True)] == pytest.approx([2, 2], rel=0.01)


def test_the_memory_split_refuses_a_cache_too_small_for_two_blocks_a_group():
    with pytest.raises(ValueError, match=r"too small.*\['full', 'budget40'\]"):
        split_kv_memory(retention(), 8 * 2**10, 1000, 100)

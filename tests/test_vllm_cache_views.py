"""The vLLM plugin's decode tables and our kernels on views of vLLM's KV cache.

vLLM hands each layer one token-major tensor (K and V side by side in each token's row); the
plugin reads it through strided views (sparse_core/vllm_plugin/decode_tables.py). Here the
Triton store, compaction and decode kernels run on those views (under the interpreter on CPU)
against the plain-torch reference and against attention computed directly over the context a
compacted request must see. No vLLM needed.
"""

from __future__ import annotations

import pytest
import torch

from sparse_core.kernels import reference as ref
from sparse_core.vllm_plugin.decode_tables import context_slot_table, pages_of, split_kv_cache
from tests.triton_setup import DEVICE, import_kernels

tk = import_kernels("sparse_core.kernels.triton_kernels")

NUM_KV, NUM_Q, HEAD, BLOCK, NUM_BLOCKS = 2, 4, 32, 8, 40


def _vllm_layer_cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A layer's cache as vLLM gives it: [blocks, kv_heads, block_size, 2 * head] over memory in
    the order [blocks, block_size, kv_heads, 2 * head] (compat.TokenMajorKVCache)."""
    memory = torch.randn(NUM_BLOCKS, BLOCK, NUM_KV, 2 * HEAD, device=DEVICE).to(dtype)
    return memory.permute(0, 2, 1, 3)


def _twin_caches(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Two copies of one random layer cache (same strides), for the kernel and the reference."""
    cache = _vllm_layer_cache(dtype)
    twin = cache.clone()
    assert twin.stride() == cache.stride()
    return {"kernel": cache, "reference": twin}


def test_split_views_share_the_cache_memory() -> None:
    cache = _vllm_layer_cache()
    k, v = split_kv_cache(cache, HEAD)
    assert k.shape == v.shape == (NUM_BLOCKS, BLOCK, NUM_KV, HEAD)
    k[3, 5, 1] = 7.0
    assert torch.equal(cache[3, 1, 5, :HEAD], torch.full((HEAD,), 7.0, device=DEVICE))
    # One-token pages are views too, token t of block b at page b * BLOCK + t.
    assert pages_of(v, 1).data_ptr() == v.data_ptr()
    assert torch.equal(pages_of(v, 1)[3 * BLOCK + 5, 0], v[3, 5])


def test_slot_table_skips_the_gap_of_a_compacted_prompt() -> None:
    # Row 0: prompt of 30 compacted to 12 kept, then 5 generated tokens (positions 30..34).
    # Row 1: prompt of 10 under the budget: nothing skipped, 3 generated.
    table = torch.randperm(NUM_BLOCKS)[:10].view(2, 5).to(torch.int32).to(DEVICE)
    skipped = torch.tensor([18, 0], dtype=torch.int32, device=DEVICE)
    slots = context_slot_table(table, BLOCK, 12, skipped, max_len=17)
    assert slots.dtype == torch.int32 and slots.shape == (2, 17)
    for row, positions in ((0, [*range(12), *range(30, 35)]), (1, list(range(13)))):
        expected = [int(table[row, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]
        assert slots[row, : len(positions)].tolist() == expected


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Kernel vs reference: bf16 outputs differ by the rounding of P in P @ V."""
    tol = 2e-2 if actual.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _direct_attention(q, keys, values, scale):
    """q [Hq, D] over one context's keys/values [L, Hkv, D], in float32."""
    group = q.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q.float(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_store_compact_and_decode_on_vllm_views(dtype: torch.dtype) -> None:
    """A full group's layer (the prompt stored whole, read through the block table in pages of
    BLOCK) and a sparse group's (the prompt compacted, read through a slot table in pages of
    one token): kernels against the reference and against the context each must see."""
    torch.manual_seed(11)
    prompt, budget, generated = 37, 16, 3
    table = torch.randperm(NUM_BLOCKS)[:6].view(1, 6).to(torch.int32).to(DEVICE)
    position_slots = (table[0, :, None] * BLOCK + torch.arange(BLOCK, device=DEVICE)).flatten()
    k, v = (torch.randn(prompt + generated, NUM_KV, HEAD, device=DEVICE).to(dtype) for _ in "kv")
    caches = _twin_caches(dtype)
    kept = torch.stack([torch.randperm(prompt)[:budget].sort().values for _ in range(NUM_KV)])
    kept = kept.to(DEVICE)
    full_slots = position_slots[: prompt + generated]
    # The sparse request's prompt tokens are stored only compacted; its generated tokens at
    # their own positions (after the gap).
    sparse_slots = full_slots.clone()
    sparse_slots[:prompt] = -1
    for name, ops in (("kernel", tk), ("reference", ref)):
        ops.store_kv(k, v, *split_kv_cache(caches[name], HEAD), full_slots)
    # Same cache contents from both stores.
    assert torch.equal(caches["kernel"], caches["reference"])
    # Compaction into a second cache (the sparse group's layer).
    sparse = _twin_caches(dtype)
    for name, ops in (("kernel", tk), ("reference", ref)):
        k_cache, v_cache = split_kv_cache(sparse[name], HEAD)
        ops.store_kv(k, v, k_cache, v_cache, sparse_slots)
        ops.store_selected_kv(
            k[:prompt], v[:prompt], kept, k_cache, v_cache, position_slots[:budget]
        )
    assert torch.equal(sparse["kernel"], sparse["reference"])

    q = torch.randn(1, NUM_Q, HEAD, device=DEVICE).to(dtype)
    context = torch.tensor([prompt + generated], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = split_kv_cache(caches["kernel"], HEAD)
    full_args = (pages_of(k_cache, BLOCK), pages_of(v_cache, BLOCK), table, context, 0.3)
    full_out = tk.paged_decode_attention(q, *full_args)
    _close(full_out, ref.paged_decode_attention(q, *full_args))
    direct = _direct_attention(q[0], k, v, 0.3)
    torch.testing.assert_close(full_out[0].float(), direct, atol=2e-2, rtol=2e-2)

    k_cache, v_cache = split_kv_cache(sparse["kernel"], HEAD)
    slots = context_slot_table(
        table, BLOCK, budget, torch.tensor([prompt - budget], device=DEVICE), budget + generated
    )
    lens = torch.tensor([budget + generated], dtype=torch.int32, device=DEVICE)
    sparse_args = (pages_of(k_cache, 1), pages_of(v_cache, 1), slots, lens, 0.3)
    sparse_out = tk.paged_decode_attention(q, *sparse_args)
    _close(sparse_out, ref.paged_decode_attention(q, *sparse_args))
    # What the compacted request must see, per KV head: its kept prompt tokens, then the
    # generated ones.
    for h in range(NUM_KV):
        rows = torch.cat([kept[h], torch.arange(prompt, prompt + generated, device=DEVICE)])
        heads = slice(h * NUM_Q // NUM_KV, (h + 1) * NUM_Q // NUM_KV)
        direct = _direct_attention(q[0, heads], k[rows, h : h + 1], v[rows, h : h + 1], 0.3)
        torch.testing.assert_close(sparse_out[0, heads].float(), direct, atol=2e-2, rtol=2e-2)

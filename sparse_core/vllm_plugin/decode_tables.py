"""How the plugin's decode reads vLLM's KV cache: views of a layer's cache and the tables that
address each decode row's context in them. Plain torch, no vLLM import, so the kernels' tests
can build the same views.

vLLM gives a layer one tensor, token-major in memory ([blocks, block_size, kv_heads, K | V],
see compat.TokenMajorKVCache). A full group's context is positions [0, seq_len): the request's
block table addresses it in pages of `block_size` tokens. A sparse group's context skips the
compacted prompt's gap: kept tokens at positions [0, kept), generated ones from the prompt's end
on. Its table lists the cache slot of every context token, read as pages of one token.
"""

from __future__ import annotations

import torch


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer view [blocks, kv_heads, block_size, 2 * head_size] -> K and V caches
    [blocks, block_size, kv_heads, head_size] (strided views of the same memory)."""
    by_token = kv_cache.transpose(1, 2)
    return by_token[..., :head_size], by_token[..., head_size:]


def pages_of(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """The cache [blocks, block_size, kv_heads, D] read as pages of `page_size` tokens (a view:
    1 for slot tables, block_size for block tables)."""
    return cache.view(-1, page_size, *cache.shape[2:])


def context_slot_table(
    block_table: torch.Tensor,
    block_size: int,
    kept: int,
    skipped: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """[R, max_len] int32 cache slots of R decode rows' contexts: context token j of row i sits
    at position j for j < kept and j + skipped[i] after (the gap of a compacted prompt; 0 for a
    prompt stored whole).

    block_table [R, max_blocks]: the rows' vLLM block tables; kept: the group's budget; skipped
    [R] on the block table's device. Entries past a row's context length are in bounds but
    meaningless (decode masks them).
    """
    j = torch.arange(max_len, device=block_table.device)
    positions = j + (j >= kept) * skipped[:, None].long()
    block_index = (positions // block_size).clamp_(max=block_table.shape[1] - 1)
    blocks = torch.gather(block_table, 1, block_index)
    return (blocks * block_size + positions % block_size).to(torch.int32)

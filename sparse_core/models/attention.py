"""Attention over the paged, per-layer-group KV cache, with compress-on-write for sparse layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparse_core.config import SparsityConfig
from sparse_core.kernels import KernelOps
from sparse_core.policy import PromptBatch, select_kept_tokens


@dataclass
class CompressJobs:
    """The prompts of a prefill step that a sparse layer group stores compressed."""

    prompts: PromptBatch
    kept_slots: torch.Tensor  # [len(prompts.bounds) * budget]: where each prompt's kept tokens go

    def __bool__(self) -> bool:
        return bool(self.prompts.bounds)


@dataclass
class GroupStepMetadata:
    """What the layers of one group need for one step.

    Prefill: `slot_mapping` [T] gives each token's slot, -1 for tokens of prompts in `compress`.
    Decode: `slot_mapping` [B] is the new token's slot; `block_tables` and `context_lens` describe
    each sequence's cached context in this group (which is shorter than the sequence in sparse
    groups).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    # A bound on context_lens known on the host: no device sync, and fixed under CUDA graphs.
    max_context_len: int | None = None
    compress: CompressJobs | None = None


@dataclass
class StepMetadata:
    is_prefill: bool
    groups: list[GroupStepMetadata]
    cu_seqlens: torch.Tensor | None = None  # prefill: packed sequence offsets
    max_seqlen: int | None = None  # prefill: longest sequence, known on the host


class PagedAttention(nn.Module):
    """Runs attention for one layer and keeps that layer's KV cache (owned by the engine)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        group: int,
        budget: int | None,
        sparsity: SparsityConfig,
        ops: KernelOps,
        kv_heads: tuple[int, int] | None = None,
    ) -> None:
        """num_heads / num_kv_heads: this rank's heads; kv_heads: (first, total) of its KV heads
        among the model's, under tensor parallelism."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.group = group
        self.budget = budget
        self.sparsity = sparsity
        self.ops = ops
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.generator: torch.Generator | None = None  # the `random` policy's draws
        self.kv_heads = kv_heads

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]."""
        group = meta.groups[self.group]
        ops = self.ops
        if not meta.is_prefill:
            ops.store_kv(k, v, self.k_cache, self.v_cache, group.slot_mapping)
            return ops.paged_decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                group.block_tables,
                group.context_lens,
                self.scale,
                group.max_context_len,
            )
        out, lse = ops.prefill_attention(q, k, v, meta.cu_seqlens, self.scale, meta.max_seqlen)
        ops.store_kv(k, v, self.k_cache, self.v_cache, group.slot_mapping)
        if group.compress:
            kept_rows = select_kept_tokens(
                self.sparsity,
                self.budget,
                q,
                k,
                lse,
                group.compress.prompts,
                self.scale,
                ops,
                self.generator,
                self.kv_heads,
            )
            ops.store_selected_kv(
                k, v, kept_rows, self.k_cache, self.v_cache, group.compress.kept_slots
            )
        return out

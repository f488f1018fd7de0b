"""Attention over the paged, per-layer-group KV cache, with compress-on-write for sparse layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparse_core.kernels import KernelOps
from sparse_core.kernels.fp8 import UNIT_SCALES, KVScales
from sparse_core.models.rotary import RotaryEmbedding
from sparse_core.selection import PromptBatch, SelectionPolicy, StreamingLLM

# What a sliding-window layer keeps of a prompt: its last tokens.
MOST_RECENT = StreamingLLM(sinks=0)


@dataclass
class CompressJobs:
    """The prompts of a prefill step that a sparse layer group stores compressed."""

    prompts: PromptBatch
    kept_slots: torch.Tensor  # [sum(prompts.kept)]: where each prompt's kept tokens go

    def __bool__(self) -> bool:
        return bool(self.prompts.bounds)


@dataclass
class PrefillGroupMetadata:
    """What the layers of one group need for the prefill part of a step."""

    slot_mapping: torch.Tensor  # [P]: each prompt token's slot, -1 for the prompts in `compress`
    compress: CompressJobs | None = None
    cached_slots: torch.Tensor | None = None  # [C]: the slots of ChunkContext's cached tokens


@dataclass
class ChunkContext:
    """For a step that continues chunked prompts: their earlier chunks, read back from the cache.

    Attention and scoring then run over keys packed apart from the queries: each prompt's cached
    tokens followed by the step's own, so its queries are its last keys.
    """

    cu_seqlens_k: torch.Tensor  # packed keys' offsets, per prompt
    num_keys: int
    new_rows: torch.Tensor  # [P]: where the step's prompt tokens go among the packed keys
    cached_rows: torch.Tensor  # [C]: where the cached tokens go

    def pack(
        self,
        ops: KernelOps,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cached_slots: torch.Tensor,
        kv_scales: KVScales,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's k, v [P, Hkv, D] and the paged caches -> packed keys and values
        [num_keys, Hkv, D] in the step's dtype, in two launches: the new rows scattered, the
        cached ones gathered (the same slots for every head), dequantized from an FP8 cache by
        its `kv_scales`, and scattered."""
        heads = k.shape[1]
        shape = (self.num_keys, 1, *k.shape[1:])  # as a paged cache of one-token blocks
        packed_k, packed_v = k.new_empty(shape), v.new_empty(shape)
        ops.store_kv(k, v, packed_k, packed_v, self.new_rows)
        ops.store_selected_kv(
            k_cache.flatten(0, 1),
            v_cache.flatten(0, 1),
            cached_slots.expand(heads, -1),
            packed_k,
            packed_v,
            self.cached_rows,
            kv_scales.inverse(),
        )
        return packed_k.squeeze(1), packed_v.squeeze(1)


@dataclass
class DecodeGroupMetadata:
    """What the layers of one group need for the decode part of a step: where each sequence's
    new token goes and its cached context in this group (shorter than the sequence in sparse
    groups)."""

    slot_mapping: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max blocks]
    context_lens: torch.Tensor  # [B], the new token included
    # A bound on context_lens known on the host: no device sync, and fixed under CUDA graphs.
    max_context_len: int


@dataclass
class PrefillMetadata:
    num_tokens: int  # P: the step's first P tokens are the prompts' (whole or a chunk), packed
    cu_seqlens: torch.Tensor  # packed prompt offsets
    max_seqlen: int  # most tokens of one prompt in the step, known on the host
    groups: list[PrefillGroupMetadata]
    context: ChunkContext | None = None  # when the step continues chunked prompts
    # Chooses the kept tokens where a group compresses: the rank's policy (the start-up
    # profile runs one of its own); None where nothing is selected (dense).
    selection: SelectionPolicy | None = None


@dataclass
class DecodeMetadata:
    groups: list[DecodeGroupMetadata]


@dataclass
class StepMetadata:
    """A step feeds the prefilled prompts' tokens (packed), then one token per decoding
    sequence; either part may be absent."""

    prefill: PrefillMetadata | None = None
    decode: DecodeMetadata | None = None


class PagedAttention(nn.Module):
    """Runs attention for one layer and keeps that layer's KV cache (owned by the engine)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        group: int,
        ops: KernelOps,
        rotary: RotaryEmbedding,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """num_heads / num_kv_heads: this rank's heads; group: the layer's layer group (the
        step's metadata says which prompts it compresses, to how many tokens); rotary: the
        layer's RoPE tables, applied to q and k as they are stored; scale: of the logits
        (default 1/sqrt(head_dim)); sliding_window: a sliding-window layer's window (its
        group holds that many tokens, so only a prefill masks the older keys), else None."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.group = group
        self.ops = ops
        self.rotary = rotary
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_scales: KVScales = UNIT_SCALES  # an FP8 cache's; 1.0 for a bf16 one

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] before RoPE (q and k are rotated in place),
        positions [T] -> [T, Hq, D]."""
        assert meta.prefill is not None or meta.decode is not None, "a step with no rows"
        out = torch.empty_like(q)
        n = 0  # the prompts' rows come first
        if meta.prefill is not None:
            n = meta.prefill.num_tokens
            self._prefill(q[:n], k[:n], v[:n], positions[:n], meta.prefill, out[:n])
        if meta.decode is not None:
            group = meta.decode.groups[self.group]
            self._decode(q[n:], k[n:], v[n:], positions[n:], group, out[n:])
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        group: DecodeGroupMetadata,
        out: torch.Tensor,
    ) -> None:
        self.ops.rotate_store_and_decode(
            q, k, v, positions, self.rotary.cos, self.rotary.sin, self.k_cache, self.v_cache,
            group.slot_mapping, group.block_tables, group.context_lens, self.scale,
            group.max_context_len, out=out, kv_scales=self.kv_scales,
        )  # fmt: skip

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        meta: PrefillMetadata,
        out: torch.Tensor,
    ) -> None:
        """RoPE on q and k, then causal attention within each prompt (over its cached chunks
        too; in a sliding-window layer over the window), written to `out`; every token's K/V is
        stored, except in a group that compresses the prompt in this step: there only the
        selected tokens are written (over the cached chunks, which held the whole prompt); a
        sliding-window layer keeps the most recent."""
        group = meta.groups[self.group]
        ops = self.ops
        self.ops.rotate_and_store_kv(
            q, k, v, positions, self.rotary.cos, self.rotary.sin, self.k_cache, self.v_cache,
            group.slot_mapping, self.kv_scales,
        )  # fmt: skip
        cu_seqlens_k = None
        if meta.context is not None:
            k, v = meta.context.pack(
                ops, k, v, self.k_cache, self.v_cache, group.cached_slots, self.kv_scales
            )
            cu_seqlens_k = meta.context.cu_seqlens_k
        _, lse = ops.prefill_attention(
            q, k, v, meta.cu_seqlens, self.scale, meta.max_seqlen, cu_seqlens_k=cu_seqlens_k,
            out=out, sliding_window=self.sliding_window,
        )  # fmt: skip
        if group.compress:
            selection = MOST_RECENT if self.sliding_window is not None else meta.selection
            assert selection is not None
            kept_rows = selection.select(q, k, lse, group.compress.prompts, self.scale)
            ops.store_selected_kv(
                k, v, kept_rows, self.k_cache, self.v_cache, group.compress.kept_slots,
                self.kv_scales,
            )  # fmt: skip

"""The attention backend vLLM runs every layer through while the plugin is active.

Full groups attend to everything; in sparse groups the step that completes a prompt scores the
prompt from its observation window, keeps `budget` tokens per KV head (the engine's selection
policy, sparse_core/selection.py, one per worker process) and stores only those, compacted into
positions [0, budget). The kernels are the engine's (plain torch on CPU, Triton on CUDA), run on
strided views of vLLM's cache (decode_tables.py).

With `kv_cache_dtype="fp8"` (vLLM's flag) the cache holds e4m3 with vLLM's per-layer K and V
scales (1.0 unless the checkpoint brings calibrated ones), written and read by the same kernels
as the engine's FP8 KV cache; prefill attention and scoring stay on the step's activations.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionType

from sparse_core.config import SparsityConfig
from sparse_core.kernels import KernelOps, get_ops
from sparse_core.kernels.fp8 import FP8_DTYPE, UNIT_SCALES, KVScales
from sparse_core.selection import PromptBatch, SelectionPolicy, selection_policy
from sparse_core.vllm_plugin.compat import BACKEND_NAME, TokenMajorKVCache
from sparse_core.vllm_plugin.decode_tables import pages_of, split_kv_cache
from sparse_core.vllm_plugin.metadata import KVSparseMetadata, KVSparseMetadataBuilder
from sparse_core.vllm_plugin.settings import current_settings

# vLLM's names of an e4m3 cache (its "fp8" means e4m3 on NVIDIA GPUs and CPUs).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


class KVSparseAttentionBackend(TokenMajorKVCache, AttentionBackend):
    # Token-major blocks (TokenMajorKVCache): a layer's cache is [blocks, block_size, kv_heads,
    # k|v], the engine's pool layout, so its kernels take views of it.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_KV_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KVSparseAttentionImpl]:
        return KVSparseAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVSparseMetadataBuilder]:
        return KVSparseMetadataBuilder


# One selection policy per worker process (a vLLM worker is one rank) and sparsity settings,
# shared by its layers: the random policy then draws one stream across them, as in the engine.
_policies: dict[tuple[str, torch.device], SelectionPolicy | None] = {}


def rank_policy(sparsity: SparsityConfig, device: torch.device) -> SelectionPolicy | None:
    key = (repr(sparsity), device)
    if key not in _policies:
        _policies[key] = selection_policy(sparsity, get_ops(device))
    return _policies[key]


class KVSparseAttentionImpl(AttentionImpl[KVSparseMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported,
    ) -> None:
        problems = [
            name
            for name, bad in (
                ("ALiBi", alibi_slopes is not None),
                ("sliding-window", sliding_window is not None),
                ("soft-capped", bool(logits_soft_cap)),
                ("non-decoder", attn_type != AttentionType.DECODER),
                ("KV-sharing", kv_sharing_target_layer_name is not None),
                ("sink", unsupported.get("sinks") is not None),
            )
            if bad
        ]
        if problems:
            raise NotImplementedError(f"kvsparse: {', '.join(problems)} attention is not supported")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        # vLLM allocates an FP8 cache as bytes; the kernels read it as e4m3.
        self.fp8_cache = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self.kv_sharing_target_layer_name = None
        settings = current_settings()
        # Without kvsparse settings (none configured) the layer attends as stock vLLM does.
        self.sparsity = settings.sparsity if settings else SparsityConfig(policy="dense")
        self.ops: KernelOps | None = None
        self.selection: SelectionPolicy | None = None

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVSparseMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:  # vLLM's profiling and warm-up runs
            return output
        m = attn_metadata
        if self.ops is None:
            self.ops = get_ops(query.device)
            self.selection = rank_policy(self.sparsity, query.device)
        ops = self.ops
        n = m.num_actual_tokens
        q, k, v = query[:n], key[:n], value[:n]
        out = output[:n]
        scales = UNIT_SCALES
        if self.fp8_cache:
            kv_cache = kv_cache.view(FP8_DTYPE)
            scales = KVScales(layer._k_scale_float, layer._v_scale_float)
        k_cache, v_cache = split_kv_cache(kv_cache, self.head_size)
        ops.store_kv(k, v, k_cache, v_cache, m.store_slots, scales)
        if m.num_prefill_tokens:
            rows = m.prefill_tokens
            qp, kp, vp = q[rows], k[rows], v[rows]
            prefill_out, lse = ops.prefill_attention(
                qp, kp, vp, m.prefill_cu_seqlens, self.scale, m.prefill_max_len
            )
            out[rows] = prefill_out.to(out.dtype)
            if m.compress_bounds:
                assert self.selection is not None and m.budget is not None
                budgets = [m.budget] * len(m.compress_bounds)
                prompts = PromptBatch.from_bounds(m.compress_bounds, budgets, query.device)
                kept = self.selection.select(qp, kp, lse, prompts, self.scale)
                ops.store_selected_kv(kp, vp, kept, k_cache, v_cache, m.kept_slots, scales)
        if m.num_decodes:
            rows = m.decode_tokens
            # Decode rows in one range (vLLM's usual order) are written in place.
            in_place = isinstance(rows, slice) and out.dtype == q.dtype
            decode_out = ops.paged_decode_attention(
                q[rows],
                pages_of(k_cache, m.decode_page_size),
                pages_of(v_cache, m.decode_page_size),
                m.decode_table,
                m.decode_context_lens,
                self.scale,
                m.decode_max_len,
                out=out[rows] if in_place else None,
                kv_scales=scales,
            )
            if not in_place:
                out[rows] = decode_out.to(out.dtype)
        return output

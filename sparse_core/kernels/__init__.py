"""Kernel sets: plain torch (CPU path and test oracle) and, on CUDA, Triton."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparse_core.kernels import reference


@dataclass(frozen=True)
class KernelOps:
    """The kernels the engine calls; each has the signature of its `reference` twin.

    `prefill_attention` returns (out, lse) where lse may be None: the caller then computes the
    window LSE with `window_lse` (the CPU path uses torch's fused SDPA, which emits no LSE).
    """

    name: str
    prefill_attention: Callable
    window_lse: Callable
    window_scores: Callable
    select_kept_rows: Callable
    store_kv: Callable
    store_selected_kv: Callable
    paged_decode_attention: Callable
    rms_norm: Callable
    silu_and_mul: Callable
    rotate_and_store_kv: Callable
    rotate_store_and_decode: Callable


def _sdpa_prefill(q, k, v, cu_seqlens, scale, max_seqlen=None, cu_seqlens_k=None, out=None):
    return reference.causal_attention(q, k, v, cu_seqlens, scale, cu_seqlens_k, out), None


REFERENCE_OPS = KernelOps(
    name="torch",
    prefill_attention=_sdpa_prefill,
    window_lse=reference.window_lse,
    window_scores=reference.window_scores,
    select_kept_rows=reference.select_kept_rows,
    store_kv=reference.store_kv,
    store_selected_kv=reference.store_selected_kv,
    paged_decode_attention=reference.paged_decode_attention,
    rms_norm=reference.rms_norm,
    silu_and_mul=reference.silu_and_mul,
    rotate_and_store_kv=reference.rotate_and_store_kv,
    rotate_store_and_decode=reference.rotate_store_and_decode,
)


def _triton_ops() -> KernelOps:
    from sparse_core.kernels import triton_fused as tf
    from sparse_core.kernels import triton_kernels as tk

    return KernelOps(
        name="triton",
        prefill_attention=tk.prefill_attention,
        window_lse=reference.window_lse,  # unused: the Triton prefill kernel emits LSE
        window_scores=tk.window_scores,
        select_kept_rows=tk.select_kept_rows,
        store_kv=tk.store_kv,
        store_selected_kv=tk.store_selected_kv,
        paged_decode_attention=tk.paged_decode_attention,
        rms_norm=tf.rms_norm,
        silu_and_mul=tf.silu_and_mul,
        rotate_and_store_kv=tk.rotate_and_store_kv,
        rotate_store_and_decode=tk.rotate_store_and_decode,
    )


def get_ops(device: torch.device) -> KernelOps:
    """Triton on CUDA devices, plain torch elsewhere."""
    if device.type == "cuda":
        return _triton_ops()
    return REFERENCE_OPS


def kernel_first_launch_seconds() -> float:
    """Host seconds this process has spent in first launches of kernel variants (Triton
    compiling them, or loading them from its cache); 0 while no Triton kernel has run."""
    launcher = sys.modules.get("sparse_core.kernels.launcher")  # never imports Triton
    return launcher.first_launch_seconds() if launcher is not None else 0.0

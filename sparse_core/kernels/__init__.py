"""Kernel sets: plain torch (CPU path and test oracle) and, on CUDA, Triton."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparse_core.kernels import reference

if TYPE_CHECKING:
    from sparse_core.kernels.launcher import FirstLaunch  # imports Triton


@dataclass(frozen=True)
class KernelOps:
    """The kernels the engine calls; each has the signature of its `reference` twin.

    `prefill_attention` returns (out, lse) where lse may be None: the caller then computes the
    window LSE with `window_lse` (the CPU path uses torch's fused SDPA, which emits no LSE).
    `rms_norm_fp8` and `act_and_mul_fp8` quantize their output for an FP8 linear layer
    (`fp8.FP8Rows`).
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
    rms_norm_fp8: Callable
    act_and_mul: Callable
    act_and_mul_fp8: Callable
    rotate_and_store_kv: Callable
    rotate_store_and_decode: Callable


def _sdpa_prefill(
    q, k, v, cu_seqlens, scale, max_seqlen=None, cu_seqlens_k=None, out=None, sliding_window=None
):
    out = reference.causal_attention(q, k, v, cu_seqlens, scale, cu_seqlens_k, out, sliding_window)
    return out, None


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
    rms_norm_fp8=reference.rms_norm_fp8,
    act_and_mul=reference.act_and_mul,
    act_and_mul_fp8=reference.act_and_mul_fp8,
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
        rms_norm_fp8=tf.rms_norm_fp8,
        act_and_mul=tf.act_and_mul,
        act_and_mul_fp8=tf.act_and_mul_fp8,
        rotate_and_store_kv=tk.rotate_and_store_kv,
        rotate_store_and_decode=tk.rotate_store_and_decode,
    )


# KernelOps fields (comma-separated, or "all") that run through `reference` even on a GPU: to
# find which kernel a wrong result on the GPU comes from, swap them in one at a time under the
# real workload (with enforce_eager: the reference kernels may read values back to the host,
# which a CUDA graph cannot capture).
REFERENCE_KERNELS_ENV = "KVSPARSE_REFERENCE_KERNELS"


def get_ops(device: torch.device) -> KernelOps:
    """Triton on CUDA devices (but for the kernels $KVSPARSE_REFERENCE_KERNELS names), plain
    torch elsewhere."""
    if device.type == "cuda":
        return with_reference_kernels(_triton_ops(), os.environ.get(REFERENCE_KERNELS_ENV, ""))
    return REFERENCE_OPS


def with_reference_kernels(ops: KernelOps, names: str) -> KernelOps:
    """`ops` with the kernels in `names` (comma-separated KernelOps fields, or "all") taken from
    the reference set."""
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    if not wanted:
        return ops
    if wanted == {"all"}:
        return REFERENCE_OPS
    known = {f.name for f in dataclasses.fields(KernelOps)} - {"name"}
    if wanted - known:
        raise ValueError(
            f"{REFERENCE_KERNELS_ENV}: unknown kernel(s) {sorted(wanted - known)}; "
            f"known: {sorted(known)} or 'all'"
        )
    return dataclasses.replace(
        ops,
        name=f"{ops.name} with {', '.join(sorted(wanted))} from {REFERENCE_OPS.name}",
        **{name: getattr(REFERENCE_OPS, name) for name in wanted},
    )


def kernel_first_launch_count() -> int:
    """How many first launches of kernel variants this process has made (Triton compiling them,
    or loading them from its cache); 0 while no Triton kernel has run."""
    launcher = sys.modules.get("sparse_core.kernels.launcher")  # never imports Triton
    return launcher.first_launch_count() if launcher is not None else 0


def kernel_first_launches(since: int) -> list[FirstLaunch]:
    """This process's first launches of kernel variants (`launcher.FirstLaunch`), oldest first,
    from the `since`-th on."""
    launcher = sys.modules.get("sparse_core.kernels.launcher")
    return launcher.first_launches(since) if launcher is not None else []

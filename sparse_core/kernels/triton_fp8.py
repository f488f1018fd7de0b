"""FP8 linear layers on the GPU (`fp8_linear_cuda`), with the per-token FP8 quantization of their
activations in one kernel (sparse_core/kernels/fp8.py's `quantize_rows`, which takes eight torch
kernels: conversions, abs, max, divide, clamps, cast).

One program per row: a pass for the row's largest magnitude, then a pass that scales, clamps and
stores e4m3. Every FP8 linear layer runs it on its input, so in a decode step it replaces about a
thousand small launches with one per layer.

The matmul takes one of two routes to the same result, by the number of rows (tokens) and the
layer's width: the route that was fastest for each of a Llama-3-8B layer's projections, the same
on the H100 and the H200 (docs/benchmarks.md, "Kernels and the decode roofline"):
- up to `few_rows_limit` rows (decode steps): a Triton kernel streams the weights, each program
  owning a slice of output channels and up to 128 rows, so that every weight byte is read once
  per 128 rows. The weight tile is the tensor cores' wide side and the rows the narrow one (the
  operands swapped, as CUTLASS does for small batches), and both scales are applied to the
  float32 accumulator before its one rounding;
- more rows (prompts): `torch._scaled_mm` (cuBLASLt) with row-wise scales (one per token, one
  per output channel) and fast accumulation, written straight into the caller's rows. Fast
  accumulation keeps the tensor cores' own accumulator instead of promoting partial sums to
  float32 every few steps, as vLLM's CUTLASS FP8 kernels on Hopper do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_core.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, FP8Rows
from sparse_core.kernels.gpu_info import has_large_shared_memory
from sparse_core.kernels.launcher import launch

if triton.knobs.runtime.interpret:
    from .triton_interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()


@triton.jit
def row_fp8_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's float32 scale from its largest magnitude (`fp8.quantize_rows`)."""
    return tl.maximum(amax / FP8_MAX, MIN_SCALE)


@triton.jit
def to_fp8(x, scale, FP8_MAX: tl.constexpr):
    """x (float32) / scale in e4m3, saturated to its range."""
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, num_cols, stride_x, stride_out,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        mask = start + cols < num_cols
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = row_fp8_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, num_cols, BLOCK):
        mask = start + cols < num_cols
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        q = to_fp8(x.to(tl.float32), scale, FP8_MAX)
        tl.store(out_ptr + row * stride_out + start + cols, q, mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as sparse_core.kernels.fp8.quantize_rows for a 2-D tensor with unit column
    stride: (x_fp8, scale (rows, 1) float32)."""
    rows, cols = x.shape
    assert x.stride(1) == 1, "columns must be contiguous"
    out = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(cols), 2048)
        _quantize_rows_kernel[(rows,)](
            x, out, scale, cols, x.stride(0), out.stride(0),
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out, scale


@triton.jit
def _few_rows_matmul_kernel(
    w_ptr, x_ptr, w_scale_ptr, x_scale_ptr, out_ptr, rows, out_features, in_features,
    stride_w, stride_x, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    # Program (i, j): output channels [i * BLOCK_N, +BLOCK_N) of rows [j * BLOCK_M, +BLOCK_M).
    # acc[channel, row] = sum_k w[channel, k] * x[row, k]: the weight tile is the dot's first
    # operand, so a handful of rows still fills the tensor cores' wide side.
    channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ids = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    channel_ok = channels < out_features
    row_ok = row_ids < rows
    w_ptrs = w_ptr + channels[:, None].to(tl.int64) * stride_w + ks[None, :]
    x_ptrs = x_ptr + row_ids[:, None].to(tl.int64) * stride_x + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=channel_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = k + ks < in_features
            w = tl.load(w_ptrs, mask=channel_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    w_scale = tl.load(w_scale_ptr + channels, mask=channel_ok, other=0.0)
    x_scale = tl.load(x_scale_ptr + row_ids, mask=row_ok, other=0.0)
    y = acc * w_scale[:, None] * x_scale[None, :]
    out_ptrs = out_ptr + row_ids[None, :].to(tl.int64) * stride_out + channels[:, None]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=channel_ok[:, None] & row_ok[None, :])


# Layers at least this wide (an MLP's gate and up) take the few-rows matmul's wide tiles.
WIDE_LAYER_CHANNELS = 16384

# Shared memory one program may take: 227 KB on data-centre GPUs (sm_90, sm_100), about 99 KB
# on Ada (sm_89, the RTX 4090) and consumer Blackwell; less this much for the epilogue.
_LARGE_SMEM, _SMALL_SMEM, _EPILOGUE_SMEM = 227 * 1024, 99 * 1024, 16 * 1024


def _few_rows_tiles(
    out_features: int, rows: int, device: torch.device
) -> tuple[int, int, int, int, int]:
    """(BLOCK_N output channels, BLOCK_M rows, BLOCK_K, num_warps, num_stages) of the few-rows
    matmul.

    A program holds up to 128 rows (more take more programs, each reading the weights again).
    Wide layers (an MLP's gate and up) take 128-channel tiles; the others 64, which gives
    enough programs to cover the SMs (docs/benchmarks.md, "Kernels and the decode roofline");
    32-channel tiles, twice the programs, were slower on the H200. tl.dot needs at least 16
    rows. Stages of tiles in flight: 4 for the wide layers, 6 for the others (the fastest on the
    H200; a down projection's 64 programs, one per SM, need the deeper pipeline to keep enough
    bytes in flight); GPUs with less shared memory get as many as fit (not measured). The
    interpreter takes small tiles, so the tests cover several of each.
    """
    if device.type != "cuda":
        return 16, 16, 32, 4, 1
    block_m = max(16, min(128, triton.next_power_of_2(rows)))
    wide = out_features >= WIDE_LAYER_CHANNELS
    block_n, block_k, most_stages = (128, 128, 4) if wide else (64, 256, 6)
    smem = (_LARGE_SMEM if has_large_shared_memory(device) else _SMALL_SMEM) - _EPILOGUE_SMEM
    stages = min(most_stages, smem // ((block_n + block_m) * block_k))  # one e4m3 byte each
    return block_n, block_m, block_k, 4, max(1, stages)


def few_rows_matmul(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """out = (x_fp8 * x_scale) @ (weight * weight_scale)^T in float32, rounded once to out's
    dtype: x_fp8 (rows, in) e4m3 with float32 x_scale (rows, 1), weight (out features, in) e4m3
    with weight_scale (out features, 1), float32 or bf16; out (rows, out features). Returns
    out."""
    rows, in_features = x_fp8.shape
    out_features = weight.shape[0]
    assert x_fp8.stride(1) == weight.stride(1) == out.stride(1) == 1, "rows must be contiguous"
    if rows == 0:
        return out
    block_n, block_m, block_k, num_warps, num_stages = _few_rows_tiles(
        out_features, rows, x_fp8.device
    )
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(rows, block_m))
    options = {"num_warps": num_warps, "num_stages": num_stages} if x_fp8.is_cuda else {}
    launch(
        _few_rows_matmul_kernel, grid,
        weight, x_fp8, weight_scale, x_scale, out, rows, out_features, in_features,
        weight.stride(0), x_fp8.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, EVEN_K=in_features % block_k == 0,
        **options,
    )  # fmt: skip
    return out


def few_rows_limit(out_features: int, device: torch.device) -> int:
    """The most rows for which the few-rows matmul beats cuBLASLt's row-wise one in a layer of
    `out_features` channels: the wider the layer, the sooner cuBLASLt's tiles cover the SMs.
    The same on the H100 and the H200 at Llama-3-8B's projections (docs/benchmarks.md, "FP8
    linear layers at decode batch sizes"): o and down (4,096 channels) up to 256 rows, qkv
    (6,144) up to 128, gate_up (28,672) up to 64. GPUs with less shared memory (the RTX 4090)
    keep 64 for every layer: above it the kernel's 128-row tiles leave them one stage in flight
    (not measured)."""
    if out_features >= WIDE_LAYER_CHANNELS or not has_large_shared_memory(device):
        return 64
    return 128 if out_features > 4096 else 256


def fp8_linear_cuda(
    x: torch.Tensor | FP8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    few_rows_max: int | None = None,
) -> torch.Tensor:
    """sparse_core/kernels/fp8.py's `fp8_linear_reference` on FP8 tensor cores, the activations
    quantized by one Triton kernel unless they come quantized; `out` (rows, out features)
    receives it if given. Inputs of at most `few_rows_max` rows (default:
    `few_rows_limit` of the layer's width) take the weight-streaming Triton matmul, more the
    row-wise scaled one."""
    if isinstance(x, FP8Rows):
        (x_fp8, x_scale), dtype, shape = (x.values, x.scale), x.dtype, x.values.shape
    else:
        x_fp8, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        dtype, shape = x.dtype, x.shape
    num_rows, out_features = x_fp8.shape[0], weight.shape[0]
    # cuBLASLt would write an output it cannot address into a copy of its own, silently.
    assert out is None or (out.dtype == dtype and out.stride(1) == 1), "out: rows of dtype"
    if few_rows_max is None:
        few_rows_max = few_rows_limit(out_features, x_fp8.device)
    if num_rows <= few_rows_max:
        target = out
        if target is None:
            target = torch.empty(num_rows, out_features, dtype=dtype, device=x_fp8.device)
        few_rows_matmul(x_fp8, x_scale, weight, weight_scale, target)
        return target if out is not None else target.reshape(*shape[:-1], out_features)
    # weight.t(): (in, out), column-major as cuBLASLt wants the second operand.
    y = torch._scaled_mm(
        x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=dtype,
        use_fast_accum=True, out=out,
    )  # fmt: skip
    return y if out is not None else y.reshape(*shape[:-1], out_features)

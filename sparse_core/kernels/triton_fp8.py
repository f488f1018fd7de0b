"""FP8 linear layers on the GPU (`fp8_linear_cuda`), with the per-token FP8 quantization of their
activations in one kernel (sparse_core/kernels/fp8.py's `quantize_rows`, which takes eight torch
kernels: conversions, abs, max, divide, clamps, cast).

One program per row: a pass for the row's largest magnitude, then a pass that scales, clamps and
stores e4m3. Every FP8 linear layer runs it on its input, so in a decode step it replaces about a
thousand small launches with one per layer.

The matmul takes one of two routes to the same result. Prompt-sized inputs go through
`torch._scaled_mm` with row-wise scales (one per token, one per output channel). At decode batch
sizes cuBLASLt's FP8 matmul with one scale per tensor is much faster than its row-wise form
(docs/benchmarks.md, "FP8 weights and FP8 KV cache"), so there the product runs unscaled into
float32 and a second small kernel applies both scales, rounding once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_core.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

# Inputs of at most this many rows (decode steps) take the unscaled matmul and the scaling kernel.
UNSCALED_MATMUL_MAX_ROWS = 256

if triton.knobs.runtime.interpret:
    from .triton_interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()


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
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, num_cols, BLOCK):
        mask = start + cols < num_cols
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        q = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        tl.store(out_ptr + row * stride_out + start + cols, q.to(tl.float8e4nv), mask=mask)


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
def _scale_product_kernel(
    acc_ptr, row_scale_ptr, col_scale_ptr, out_ptr, num_cols, stride_acc, stride_out,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    acc = tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0.0)
    scale = tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, acc * scale, mask=mask)


def scale_product(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out = acc * row_scale * col_scale^T (acc (rows, cols) float32, row_scale (rows, 1),
    col_scale (cols, 1)), rounded once to out's dtype; returns out."""
    rows, cols = acc.shape
    assert acc.stride(1) == 1 and out.stride(1) == 1, "columns must be contiguous"
    if rows:
        block = 1024
        _scale_product_kernel[(rows, triton.cdiv(cols, block))](
            acc, row_scale, col_scale, out, cols, acc.stride(0), out.stride(0),
            BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 scale of 1 on `device`, made on first use and kept."""
    if device not in _UNIT_SCALES:
        _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT_SCALES[device]


def fp8_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    max_unscaled: int = UNSCALED_MATMUL_MAX_ROWS,
) -> torch.Tensor:
    """sparse_core/kernels/fp8.py's `fp8_linear_reference` on FP8 tensor cores, the activations
    quantized by one Triton kernel; `out` (rows, out features) receives it if given. Inputs of
    at most `max_unscaled` rows take the unscaled matmul and the scaling kernel."""
    rows = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = quantize_rows(rows)
    if rows.shape[0] <= max_unscaled:
        unit = _unit_scale(x.device)
        acc = torch._scaled_mm(
            x_fp8, weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32
        )
        if out is not None:
            return scale_product(acc, x_scale, weight_scale, out)
        y = scale_product(acc, x_scale, weight_scale, torch.empty_like(acc, dtype=x.dtype))
    else:
        y = torch._scaled_mm(
            x_fp8,
            weight.t(),  # (in, out), column-major as cuBLASLt wants the second operand
            scale_a=x_scale,
            scale_b=weight_scale.view(1, -1),
            out_dtype=x.dtype,
        )
        if out is not None:
            return out.copy_(y)
    return y.reshape(*x.shape[:-1], weight.shape[0])

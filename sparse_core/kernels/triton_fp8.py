"""FP8 linear layers on the GPU (`fp8_linear_cuda`), with the per-token FP8 quantization of their
activations in one kernel (sparse_core/kernels/fp8.py's `quantize_rows`, which takes eight torch
kernels: conversions, abs, max, divide, clamps, cast).

One program per row: a pass for the row's largest magnitude, then a pass that scales, clamps and
stores e4m3. Every FP8 linear layer runs it on its input, so in a decode step it replaces about a
thousand small launches with one per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_core.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

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


def fp8_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sparse_core/kernels/fp8.py's `fp8_linear_reference` on FP8 tensor cores, the activations
    quantized by one Triton kernel; `out` (rows, out features) receives it if given."""
    rows = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = quantize_rows(rows)
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

"""Fused element-wise Triton kernels of the decoder layer: RMSNorm (with the residual add) and
the MLP's activation-and-multiply, SiLU or GELU (rotary embedding, fused with the KV store, is
with the attention kernels in `triton_kernels.py`). Each also comes quantizing its output per
token for an FP8 linear layer (`rms_norm_fp8`, `act_and_mul_fp8`): the FP8 layer then skips its
own pass over the activations, which read them twice and wrote them once more.

A decode step is a few hundred tiny kernels; on a GPU each costs a few microseconds however
little it does, so folding ~8 element-wise launches into one per operation is what brings a
CUDA-graph replay close to the weight-read time. Rounding follows the unfused torch code
(`reference.py`): intermediates are rounded to the activation dtype where torch would round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from sparse_core.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, FP8Rows
from sparse_core.kernels.launcher import launch
from sparse_core.kernels.reference import check_activation
from sparse_core.kernels.triton_fp8 import row_fp8_scale, to_fp8
from sparse_core.kernels.triton_kernels import early_launch

# act_and_mul_fp8 computes a row of up to this many columns once, in one block of 16 warps (32
# values a thread), and a wider row twice (a pass for its scale, then the values again, which
# reads the input twice). Under the interpreter (CPU tests) rows past 64 columns take two
# passes, so that the tests' widths cover both forms.
ONE_PASS_COLUMNS = 16384
INTERPRETER_ONE_PASS_COLUMNS = 64

if triton.knobs.runtime.interpret:
    from sparse_core.kernels.triton_interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream's dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(x.dtype)  # rounded as the unfused output
    if QUANTIZE:
        yf = y.to(tl.float32)
        scale = row_fp8_scale(tl.max(tl.abs(yf), 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + cols, to_fp8(yf, scale, FP8_MAX), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def _rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    scale: torch.Tensor | None,
) -> torch.Tensor:
    """Launches the kernel into `out` (and `scale` when quantizing); returns x + residual."""
    rows, cols = x.shape
    res_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    launch(
        _rms_norm_kernel, (rows,),
        x, res, weight, out, res_out, out if scale is None else scale,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, QUANTIZE=scale is not None, FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE, BLOCK=triton.next_power_of_2(cols), **early_launch(x),
    )  # fmt: skip
    return res_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual, the second is x."""
    out = torch.empty_like(x)
    return out, _rms_norm(x, weight, eps, residual, out, None)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[FP8Rows, torch.Tensor]:
    """`rms_norm` with its output quantized per row (`reference.rms_norm_fp8`)."""
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    res_out = _rms_norm(x, weight, eps, residual, out, scale)
    return FP8Rows(out, scale, x.dtype), res_out


@triton.jit
def _act_times_up(x_ptr, stride_x, row, cols, mask, n_cols, GELU: tl.constexpr):
    """act(gate) * up at `cols` of a row of x = [gate | up], rounded to x's dtype as the torch
    code rounds it: the activation, then the product."""
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU:
        # GELU's tanh approximation: 0.5 (1 + tanh(z)) = sigmoid(2 z), z = sqrt(2 / pi) (g +
        # 0.044715 g^3).
        z2 = 1.5957691216057308 * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-z2))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols,
    GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = _act_times_up(x_ptr, stride_x, row, cols, mask, n_cols, GELU)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def _act_and_mul_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, stride_x, stride_o, n_cols,
    GELU: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per row. A row that fits one block is computed once and held while its
    # largest magnitude is found; a wider one takes a pass for its largest magnitude, then one
    # that computes the same values again (their inputs now in L2), reading them twice.
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offsets < n_cols
        y = _act_times_up(x_ptr, stride_x, row, offsets, mask, n_cols, GELU).to(tl.float32)
        scale = row_fp8_scale(tl.max(tl.abs(y), 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + offsets, to_fp8(y, scale, FP8_MAX), mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            y = _act_times_up(x_ptr, stride_x, row, cols, cols < n_cols, n_cols, GELU)
            amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        scale = row_fp8_scale(tl.max(amax, 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            mask = cols < n_cols
            y = _act_times_up(x_ptr, stride_x, row, cols, mask, n_cols, GELU)
            out = to_fp8(y.to(tl.float32), scale, FP8_MAX)
            tl.store(out_ptr + row * stride_o + cols, out, mask)


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> act(gate) * up, [T, I] (`reference.act_and_mul`)."""
    check_activation(activation)
    rows, width = x.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block = 1024
    launch(
        _act_and_mul_kernel, (rows, triton.cdiv(half, block)),
        x, out, x.stride(0), out.stride(0), half,
        GELU=activation == "gelu_pytorch_tanh", BLOCK=block, **early_launch(x),
    )  # fmt: skip
    return out


def act_and_mul_fp8(x: torch.Tensor, activation: str = "silu") -> FP8Rows:
    """`act_and_mul` with its output quantized per row (`reference.act_and_mul_fp8`)."""
    check_activation(activation)
    rows, width = x.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(half)
        one_pass = block <= (ONE_PASS_COLUMNS if x.is_cuda else INTERPRETER_ONE_PASS_COLUMNS)
        launch(
            _act_and_mul_fp8_kernel, (rows,),
            x, out, scale, x.stride(0), out.stride(0), half,
            GELU=activation == "gelu_pytorch_tanh", FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            BLOCK=block if one_pass else min(2048, block), ONE_PASS=one_pass,
            **early_launch(x), **({"num_warps": 16} if x.is_cuda and one_pass else {}),
        )  # fmt: skip
    return FP8Rows(out, scale, x.dtype)

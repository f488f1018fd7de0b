"""Fused element-wise Triton kernels of the decoder layer: RMSNorm (with the residual add) and
the MLP's activation-and-multiply, SiLU or GELU (rotary embedding, fused with the KV store, is
with the attention kernels in `triton_kernels.py`).

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

from sparse_core.kernels.launcher import launch
from sparse_core.kernels.reference import check_activation
from sparse_core.kernels.triton_kernels import early_launch

if triton.knobs.runtime.interpret:
    from sparse_core.kernels.triton_interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
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
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual, the second is x."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    launch(
        _rms_norm_kernel, (rows,),
        x, res, weight, out, res_out,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols), **early_launch(x),
    )  # fmt: skip
    return out, res_out


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols,
    GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
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
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


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

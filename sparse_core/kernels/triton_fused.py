"""Fused element-wise Triton kernels of the decoder layer: RMSNorm (with the residual add),
SiLU-and-multiply, and rotary embedding applied in place to q and k as k and v are stored into
the paged KV cache.

A decode step is a few hundred tiny kernels; on a GPU each costs a few microseconds however
little it does, so folding ~8 element-wise launches into one per operation is what brings a
CUDA-graph replay close to the weight-read time. Rounding follows the unfused torch code
(`reference.py`): intermediates are rounded to the activation dtype where torch would round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_core.kernels.launcher import launch
from sparse_core.kernels.triton_kernels import check_head_dim

if triton.knobs.runtime.interpret:
    from sparse_core.kernels.triton_interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
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
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
    )  # fmt: skip
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    rows, width = x.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block = 1024
    launch(
        _silu_and_mul_kernel, (rows, triton.cdiv(half, block)),
        x, out, x.stride(0), out.stride(0), half, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _rotate_heads(base, cos, sin, mask, HALF: tl.constexpr):
    """Rotate in place the [heads, 2 * HALF] rows at `base`; returns the rounded halves."""
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    r1 = (f1 * cos - f2 * sin).to(x1.dtype)
    r2 = (f2 * cos + f1 * sin).to(x1.dtype)
    tl.store(base, r1, mask=mask)
    tl.store(base + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _rotate_and_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    num_q_heads, num_kv_heads, block_size,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_ptr + pos * stride_c + dims)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + dims)[None, :]
    q_heads = tl.arange(0, BLOCK_HQ)[:, None]
    q_base = q_ptr + token * stride_qt + q_heads * stride_qh + dims[None, :]
    _rotate_heads(q_base, cos, sin, q_heads < num_q_heads, HALF)
    kv_heads = tl.arange(0, BLOCK_HKV)[:, None]
    kv_mask = kv_heads < num_kv_heads
    k_base = k_ptr + token * stride_kt + kv_heads * stride_kh + dims[None, :]
    k1, k2 = _rotate_heads(k_base, cos, sin, kv_mask, HALF)
    slot = tl.load(slots_ptr + token).to(tl.int64)  # a cache can pass 2**31 elements
    if slot >= 0:
        page, offset = slot // block_size, slot % block_size
        k_row = page * stride_kcb + offset * stride_kct + kv_heads * stride_kch
        k_dst = k_cache_ptr + k_row + dims[None, :]
        tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        row = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(v_ptr + token * stride_vt + kv_heads * stride_vh + row, mask=kv_mask)
        v_row = page * stride_vcb + offset * stride_vct + kv_heads * stride_vch
        tl.store(v_cache_ptr + v_row + row, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rotate_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """RoPE in place on q [T, Hq, D] and k [T, Hkv, D] (views into the fused qkv projection
    work), and k and v stored into the paged caches [blocks, block_size, Hkv, D] at
    `slot_mapping` [T] (-1 skips): one launch where a rotation and a store took two."""
    tokens, num_q, head_dim = q.shape
    num_kv = k.shape[1]
    check_head_dim(head_dim)
    assert k.shape == v.shape == (tokens, num_kv, head_dim) and q.dtype == k.dtype
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv, head_dim)
    assert positions.shape == slot_mapping.shape == (tokens,)
    assert (
        cos.shape == sin.shape and cos.shape[-1] == head_dim // 2 and cos.stride() == sin.stride()
    )
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dim must be contiguous"
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and slot_mapping.is_contiguous()
    assert positions.is_contiguous() and cos.stride(-1) == 1
    if tokens == 0:
        return
    launch(
        _rotate_and_store_kernel, (tokens,),
        q, k, v, positions, cos, sin, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q, num_kv, k_cache.shape[1],
        HALF=head_dim // 2, BLOCK_HQ=triton.next_power_of_2(num_q),
        BLOCK_HKV=triton.next_power_of_2(num_kv),
    )  # fmt: skip

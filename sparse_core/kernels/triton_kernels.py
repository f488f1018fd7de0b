"""Triton GPU kernels with the signatures and semantics of `reference.py` (the oracle).

Layouts are the reference's: packed varlen q [T, Hq, D] and k, v [T, Hkv, D] with `cu_seqlens`;
paged caches [num_blocks, block_size, Hkv, D], slot = block * block_size + offset; LSE float32
[Hq, T] in natural log. Inputs may be fp32, bf16 or fp16; every kernel accumulates in fp32. The head
dim must be a power of two in [16, 256] (64 and 128 are the tuned cases). A paged cache may also be
FP8 e4m3, holding k / kv_scales.k and v / kv_scales.v (`fp8.KVScales`): the kernels that write it
multiply by the inverse scale and saturate, those that read it convert to the queries' dtype and
fold the scales into the logits' scale (K) and the output (V).

Softmax runs in base 2 (`exp2` is one instruction, `exp` is not): logits are pre-multiplied by
scale·log2(e) and LSE is converted back to natural log on store.

The kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1
set before this module is imported; see `triton_interpreter.py`), which the tests use. The
interpreter gets small tiles so that tiny test shapes still cross tile boundaries. Off the GPU the
engine should use `reference.py`, which is far faster than the interpreter.

Tile sizes were chosen by timing them (docs/benchmarks.md); `sparse_core.bench.kernels` re-measures.
Prefill attention reads keys and values through TMA tensor descriptors on NVIDIA GPUs from
Hopper on (and under the interpreter); on older GPUs, and for tensors TMA cannot address, by
pointers. The tests run both.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

import sparse_core.kernels.reference as reference
from sparse_core.kernels.fp8 import FP8_DTYPE, FP8_MAX, UNIT_SCALES, KVScales
from sparse_core.kernels.gpu_info import gpu_properties, has_large_shared_memory
from sparse_core.kernels.launcher import launch

if triton.knobs.runtime.interpret:
    from .triton_interpreter import apply_interpreter_fixes

    apply_interpreter_fixes()

LOG2E = math.log2(math.e)  # host side; inside kernels the constants are written out
_FP8_MAX = tl.constexpr(FP8_MAX)


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")


def _launch_options(x: torch.Tensor, num_warps: int, num_stages: int) -> dict[str, int]:
    """Warps and pipeline stages for a GPU launch; the interpreter takes none."""
    return {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}


def early_launch(x: torch.Tensor) -> dict[str, bool]:
    """The constexpr PDL and the launch option for programmatic dependent launch, on GPUs from
    Hopper on: the kernel is launched as the kernel before it finishes (its blocks resident
    early), and waits in `gdc_wait()`, its first statement, until that kernel's writes are
    visible. In a decode step every one of these kernels follows a matmul, and the launch's
    latency is what this hides. Off elsewhere: older NVIDIA GPUs, ROCm, the interpreter."""
    if not x.is_cuda:
        return {"PDL": False}
    pdl = torch.version.hip is None and gpu_properties(x.device).major >= 9
    return {"PDL": pdl, "launch_pdl": pdl}


# ---------------------------------------------------------------------------------------------
# Shared pieces of the two attention kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, MASKED_ROWS: tl.constexpr = False):
    """Fold one tile of base-2 logits s [M, N] and its values v [N, D] into the running state.

    m_i is the running row max, l_i the running sum of exp2(s - m_i), acc the unnormalised output.
    Without MASKED_ROWS the caller guarantees every row of s has at least one finite entry (no
    -inf - -inf NaN); with it, a row that has seen no key yet stays empty.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if MASKED_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


# ---------------------------------------------------------------------------------------------
# 1. Varlen causal prefill attention with LSE
# ---------------------------------------------------------------------------------------------


@triton.jit
def _prefill_key_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_src,
    v_src,
    stride_kt,
    stride_vt,
    k_row0,
    col,
    rows,
    lo,
    hi,
    scale_log2,
    window,
    CAUSAL_MASK: tl.constexpr,
    SLIDING: tl.constexpr,
    TMA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Attend the query tile (at key positions `rows`) to keys [lo, hi); mask (causal and
    key < hi, and with SLIDING keys older than the row's last `window`) only where asked: a
    sliding mask needs the causal one. k_src / v_src: tensor descriptors of the [T, Hkv * D]
    keys and values (TMA), whose tile at row k_row0 + key, column `col` is wanted; else
    pointers to the prompt's first key of this head."""
    dims = tl.arange(0, HEAD_DIM)
    for key_start in range(lo, hi, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        if TMA:
            # A tile may run past hi into the next prompt's rows (or zeros past the tensor): their
            # logits are masked below, and their values zeroed, so that an Inf or NaN there
            # cannot reach this prompt through 0 * v.
            row = (k_row0 + key_start).to(tl.int32)  # TMA takes 32-bit coordinates
            k = k_src.load([row, col])
            v = v_src.load([row, col])
            if CAUSAL_MASK:
                v = tl.where(key_ok[:, None], v, 0.0)
        else:
            k_ptrs = k_src + keys[:, None] * stride_kt + dims[None, :]
            v_ptrs = v_src + keys[:, None] * stride_vt + dims[None, :]
            if CAUSAL_MASK:
                k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        if CAUSAL_MASK:
            visible = (keys[None, :] <= rows[:, None]) & key_ok[None, :]
            if SLIDING:
                # Padded rows (past hi) are read as the last key's, which they then see.
                newest = tl.minimum(rows, hi - 1)
                visible &= keys[None, :] > newest[:, None] - window
            s = tl.where(visible, s, float("-inf"))
        # A sliding window's first tiles may lie wholly before some rows' windows.
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, MASKED_ROWS=SLIDING)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_lh"])  # the step's token count; see _window_scores_kernel
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_seqlens_ptr,
    cu_seqlens_k_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    scale_log2,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # k_ptr / v_ptr: tensor descriptors with TMA, else the keys' and values' base pointers.
    # Heaviest tiles (furthest down the diagonal) are launched first so the tail of the grid is
    # made of short programs.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    start = tl.load(cu_seqlens_ptr + seq)
    n = tl.load(cu_seqlens_ptr + seq + 1) - start
    m_start = m_block * BLOCK_M
    if m_start >= n:
        return
    # A prompt chunk's queries are the last n of its keys; `first` is the key of query row 0.
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    num_keys = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    first = num_keys - n

    rows = m_start + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    col = kv_head * HEAD_DIM
    if TMA:
        k_src, v_src = k_ptr, v_ptr
    else:
        k_src = k_ptr + k_start * stride_kt + kv_head * stride_kh
        v_src = v_ptr + k_start * stride_vt + kv_head * stride_vh

    diagonal = first + m_start
    end = tl.minimum(diagonal + BLOCK_M, num_keys)
    if SLIDING:
        # From the key tile of the first row's oldest visible key to the diagonal block's end,
        # every tile masked (causal and window).
        lo = tl.maximum(diagonal - window + 1, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _prefill_key_tiles(
            acc, m_i, l_i, q, k_src, v_src, stride_kt, stride_vt, k_start, col, first + rows,
            lo, end, scale_log2, window, CAUSAL_MASK=True, SLIDING=True, TMA=TMA,
            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
        )  # fmt: skip
    else:
        # Whole key tiles left of this tile's diagonal block are visible to every row: no
        # mask. Without earlier chunks (first = 0) they end exactly at the diagonal, BLOCK_M
        # being a multiple of BLOCK_N.
        unmasked_end = diagonal // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _prefill_key_tiles(
            acc, m_i, l_i, q, k_src, v_src, stride_kt, stride_vt, k_start, col, first + rows,
            0, unmasked_end, scale_log2, window, CAUSAL_MASK=False, SLIDING=False, TMA=TMA,
            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
        )  # fmt: skip
        # The rest up to the diagonal block's end: causal mask; key tiles beyond it are never
        # visited. Every row, padded ones included, sees key unmasked_end, so no row is all
        # -inf.
        acc, m_i, l_i = _prefill_key_tiles(
            acc, m_i, l_i, q, k_src, v_src, stride_kt, stride_vt, k_start, col, first + rows,
            unmasked_end, end, scale_log2, window, CAUSAL_MASK=True, SLIDING=False, TMA=TMA,
            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
        )  # fmt: skip

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # base-2 LSE -> natural log
    tl.store(lse_ptr + head * stride_lh + start + rows, lse, mask=row_ok)


def _prefill_tiles(k: torch.Tensor, tma: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel.

    At D=128, keys and values read through TMA run fastest in 128x128 tiles with 8 warps and 3
    stages, ahead of 128x64 tiles. Those need the shared memory of a data-centre GPU (sm_90,
    sm_100: 227 KB a block, not the ~100 KB of sm_120) and 2-byte elements. Read by pointers,
    128x64 tiles with 8 warps and 3 stages were the fastest of nine shapes (128x128 with 4
    stages does not fit). Timings: docs/benchmarks.md, "Kernels and the decode roofline".
    D=256 halves both tiles to fit. The interpreter gets 32x16 so tiny tests cross tile boundaries.
    """
    head_dim = k.shape[-1]
    if not k.is_cuda:
        return 32, 16, 4, 1
    # Float32 read through TMA takes more shared memory: at D=128, 3 stages of 128x64 tiles
    # need 262 KB (measured), so one stage fewer.
    wide_tma = tma and k.element_size() > 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        large_smem = has_large_shared_memory(k.device)
        if tma and not wide_tma and large_smem:
            return 128, 128, 8, 3
        return 128, 64, 8, 2 if wide_tma else 3
    return 64, 32, 4, 1 if wide_tma else 2


def _tma_supported(device: torch.device) -> bool:
    """Tensor memory accelerator loads: NVIDIA GPUs from Hopper on, and the interpreter (CPU),
    which runs the same kernel."""
    if device.type != "cuda":
        return True
    return torch.version.hip is None and gpu_properties(device).major >= 9


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] as a [T, H * D] view when its heads lie side by side and TMA can address it
    (16-byte aligned start and rows), else None."""
    row_bytes = x.stride(0) * x.element_size()
    if x.stride(2) != 1 or x.stride(1) != x.shape[2] or row_bytes % 16 or x.data_ptr() % 16:
        return None
    return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each packed sequence; returns (out [T, Hq, D], lse [Hq, T]).

    `max_seqlen` (the most queries of a sequence) sizes the grid; pass it to avoid a
    device-to-host sync on cu_seqlens. `cu_seqlens_k`: keys packed apart from the queries, and
    `sliding_window`, as in `reference.prefill_attention`. `out`: where to write the output
    (default: a new tensor; its head dim must be contiguous).
    """
    num_tokens, num_q, head_dim = q.shape
    num_kv = k.shape[1]
    check_head_dim(head_dim)
    assert num_q % num_kv == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dim must be contiguous"
    cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    assert cu_seqlens.is_contiguous() and cu_seqlens_k.is_contiguous()
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    lse = torch.empty(num_q, num_tokens, dtype=torch.float32, device=q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out, lse
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    k_rows, v_rows = _as_rows(k), _as_rows(v)
    tma = _tma_supported(q.device) and k_rows is not None and v_rows is not None
    block_m, block_n, num_warps, num_stages = _prefill_tiles(k, tma)
    k_src, v_src = k, v
    if tma:
        k_src, v_src = (
            TensorDescriptor.from_tensor(x, [block_n, head_dim]) for x in (k_rows, v_rows)
        )
    grid = (triton.cdiv(max_seqlen, block_m), num_seqs, num_q)
    launch(
        _prefill_kernel, grid,
        q, k_src, v_src, out, lse, cu_seqlens, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        scale * LOG2E, sliding_window or 0,
        GROUP=num_q // num_kv, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma,
        SLIDING=sliding_window is not None,
        **_launch_options(q, num_warps, num_stages),
    )  # fmt: skip
    return out, lse


# ---------------------------------------------------------------------------------------------
# 2. One-pass window scoring from LSE
# ---------------------------------------------------------------------------------------------


# Triton compiles a variant for each new specialisation of an integer argument (equal to 1,
# divisible by 16, or neither). Arguments that vary from request to request (prompt lengths, a
# step's token count, row counts, the width of a step's block tables), and the strides that equal
# them, are left unspecialised, so that serving never stops to compile a kernel after start-up
# (a compile stalls the step that needs it for far longer than a step; docs/benchmarks.md).
@triton.jit(do_not_specialize=["num_scored", "stride_lh", "stride_oh"])
def _window_scores_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    out_ptr,
    num_scored,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_lh,
    stride_lt,
    stride_oh,
    scale_log2,
    GROUP: tl.constexpr,
    REDUCE_MAX: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # Keys outer, queries inner: this program owns BLOCK_N keys of one KV head, loads them once,
    # and streams the group's window queries past them; column sums never leave registers.
    key_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < num_scored
    dims = tl.arange(0, HEAD_DIM)
    k_ptrs = k_ptr + keys[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
    k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)

    score = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        column = tl.zeros([BLOCK_N], dtype=tl.float32)
        for w_start in range(0, window, BLOCK_W):
            w_idx = w_start + tl.arange(0, BLOCK_W)
            w_ok = w_idx < window
            q_ptrs = q_ptr + w_idx[:, None] * stride_qt + head * stride_qh + dims[None, :]
            q = tl.load(q_ptrs, mask=w_ok[:, None], other=0.0)
            # Padded query rows get LSE = +inf, so they add exp(-inf) = 0.
            lse = tl.load(
                lse_ptr + head * stride_lh + w_idx * stride_lt, mask=w_ok, other=float("inf")
            )
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            column += tl.sum(tl.exp2(s - lse[:, None] * 1.4426950408889634), 0)  # log2(e)
        if REDUCE_MAX:
            score = tl.maximum(score, column)
        else:
            score += column
    if not REDUCE_MAX:
        score = score / GROUP
    tl.store(out_ptr + kv_head * stride_oh + keys, score, mask=key_ok)


def window_scores(
    q_win: torch.Tensor,
    k: torch.Tensor,
    lse_win: torch.Tensor,
    scale: float,
    gqa_reduce: str = "mean",
) -> torch.Tensor:
    """Attention keys [0, n - w) receive from the w window queries, per KV head: float32 [Hkv, n - w].

    q_win [w, Hq, D], k [n, Hkv, D], lse_win [Hq, w]; see `reference.window_scores`.
    """
    if gqa_reduce not in ("mean", "max"):
        raise ValueError(f"unknown gqa_reduce {gqa_reduce!r}; expected 'mean' or 'max'")
    window, num_q, head_dim = q_win.shape
    n, num_kv = k.shape[0], k.shape[1]
    check_head_dim(head_dim)
    assert q_win.stride(-1) == k.stride(-1) == 1, "head dim must be contiguous"
    num_scored = n - window
    out = torch.empty(num_kv, max(num_scored, 0), dtype=torch.float32, device=k.device)
    if num_scored <= 0:
        return out
    # 64 keys x 32 window queries per dot: w is usually 8-64, and 64 keys gives n/64 * Hkv
    # programs (504 at n=4000, Hkv=8), a few waves on a 132-SM GPU.
    block_n = 64 if k.is_cuda else 16
    block_w = min(max(triton.next_power_of_2(window), 16), 32 if k.is_cuda else 16)
    grid = (triton.cdiv(num_scored, block_n), num_kv)
    launch(
        _window_scores_kernel, grid,
        q_win, k, lse_win, out, num_scored, window,
        q_win.stride(0), q_win.stride(1), k.stride(0), k.stride(1),
        lse_win.stride(0), lse_win.stride(1), out.stride(0),
        scale * LOG2E,
        GROUP=num_q // num_kv, REDUCE_MAX=gqa_reduce == "max", HEAD_DIM=head_dim,
        BLOCK_N=block_n, BLOCK_W=block_w,
        **_launch_options(k, 4, 2),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# 2b. RoPE applied in place to q and k as k and v are stored into the paged caches
# ---------------------------------------------------------------------------------------------


@triton.jit
def _to_cache(x, factor, cache_ptr):
    """x * factor in the cache's dtype, computed in float32; saturated to e4m3's range for an
    FP8 cache (Triton's conversion would give NaN past it), as `reference.to_cache`."""
    y = x.to(tl.float32) * factor
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        y = tl.clamp(y, -_FP8_MAX, _FP8_MAX)
    return y.to(cache_ptr.dtype.element_ty)


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
def _rotate_and_store_token(
    q_rows, q_ok, k_rows, v_rows, kv_heads, kv_ok, pos, slot,
    cos_ptr, sin_ptr, stride_c, k_cache_ptr, v_cache_ptr,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, block_size,
    k_factor, v_factor, HALF: tl.constexpr,
):  # fmt: skip
    """One token at position `pos`: RoPE in place on the query heads whose rows start at q_rows
    [heads, 1] and on the key heads at k_rows [heads, 1]; then the rotated keys and the values
    (rows at v_rows), times k_factor and v_factor, written into the caches at `slot` (nothing
    for -1), as KV heads `kv_heads` [heads, 1]."""
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_c + dims)
    sin = tl.load(sin_ptr + pos * stride_c + dims)
    _rotate_heads(q_rows + dims, cos, sin, q_ok, HALF)
    k1, k2 = _rotate_heads(k_rows + dims, cos, sin, kv_ok, HALF)
    if slot >= 0:
        page, offset = slot // block_size, slot % block_size
        k_dst = k_cache_ptr + page * stride_kcb + offset * stride_kct + kv_heads * stride_kch + dims
        tl.store(k_dst, _to_cache(k1, k_factor, k_cache_ptr), mask=kv_ok)
        tl.store(k_dst + HALF, _to_cache(k2, k_factor, k_cache_ptr), mask=kv_ok)
        row = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(v_rows + row, mask=kv_ok)
        v_dst = v_cache_ptr + page * stride_vcb + offset * stride_vct + kv_heads * stride_vch + row
        tl.store(v_dst, _to_cache(v, v_factor, v_cache_ptr), mask=kv_ok)


@triton.jit
def _rotate_and_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    num_q_heads, num_kv_heads, block_size, k_factor, v_factor,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    q_heads = tl.arange(0, BLOCK_HQ)[:, None]
    kv_heads = tl.arange(0, BLOCK_HKV)[:, None]
    _rotate_and_store_token(
        q_ptr + token * stride_qt + q_heads * stride_qh, q_heads < num_q_heads,
        k_ptr + token * stride_kt + kv_heads * stride_kh,
        v_ptr + token * stride_vt + kv_heads * stride_vh, kv_heads, kv_heads < num_kv_heads,
        tl.load(pos_ptr + token),
        tl.load(slots_ptr + token).to(tl.int64),  # a cache can pass 2**31 elements
        cos_ptr, sin_ptr, stride_c, k_cache_ptr, v_cache_ptr,
        stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, block_size,
        k_factor, v_factor, HALF=HALF,
    )  # fmt: skip


def _check_rotate_and_store(
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
    tokens, _, head_dim = q.shape
    num_kv = k.shape[1]
    check_head_dim(head_dim)
    assert k.shape == v.shape == (tokens, num_kv, head_dim) and q.dtype == k.dtype
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv, head_dim)
    assert k_cache.dtype == v_cache.dtype
    assert positions.shape == slot_mapping.shape == (tokens,)
    assert (
        cos.shape == sin.shape and cos.shape[-1] == head_dim // 2 and cos.stride() == sin.stride()
    )
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dim must be contiguous"
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and slot_mapping.is_contiguous()
    assert positions.is_contiguous() and cos.stride(-1) == 1


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
    kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """RoPE in place on q [T, Hq, D] and k [T, Hkv, D] (views into the fused qkv projection
    work), and k / kv_scales.k and v / kv_scales.v stored into the paged caches [blocks,
    block_size, Hkv, D] at `slot_mapping` [T] (-1 skips): one launch where a rotation and a
    store took two."""
    _check_rotate_and_store(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    tokens, num_q, head_dim = q.shape
    num_kv = k.shape[1]
    if tokens == 0:
        return
    launch(
        _rotate_and_store_kernel, (tokens,),
        q, k, v, positions, cos, sin, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q, num_kv, k_cache.shape[1], 1.0 / kv_scales.k, 1.0 / kv_scales.v,
        HALF=head_dim // 2, BLOCK_HQ=triton.next_power_of_2(num_q),
        BLOCK_HKV=triton.next_power_of_2(num_kv),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3. Paged decode attention (GQA-grouped, optional split-K)
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_bt"])  # see _window_scores_kernel
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_new_ptr,
    v_new_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_c,
    scale_log2,
    v_scale,
    k_factor,
    v_factor,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    WHOLE_PAGES: tl.constexpr,
    ROTATE_STORE: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program = one sequence x one KV head x one split of its keys. All GROUP query heads of
    # the KV head ride in one [BLOCK_G, D] tile, so each K/V byte is read once per step.
    if PDL:
        gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    if ROTATE_STORE:
        # Unsplit, this program alone reads this KV head's queries and new key of the sequence:
        # it rotates them and stores the key and value itself (as rotate_and_store_kv would),
        # then waits for all its threads, so that the loads below see what they wrote.
        head = tl.zeros([1, 1], dtype=tl.int32) + kv_head
        _rotate_and_store_token(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh, g_ok[:, None],
            k_new_ptr + seq * stride_knb + head * stride_knh,
            v_new_ptr + seq * stride_vnb + head * stride_vnh, head, head >= 0,
            tl.load(pos_ptr + seq), tl.load(slots_ptr + seq).to(tl.int64),
            cos_ptr, sin_ptr, stride_c, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, block_size,
            k_factor, v_factor, HALF=HEAD_DIM // 2,
        )  # fmt: skip
        tl.debug_barrier()
    context_len = tl.load(context_lens_ptr + seq)
    lo = 0
    hi = context_len
    if SPLIT:
        # Each sequence's own context is cut into equal runs of whole tiles: the work stays
        # balanced whatever the lengths, under a graph captured before they were known.
        per_split = tl.cdiv(tl.cdiv(context_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, context_len)

    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        # Every e4m3 value is exact in fp16, and bf16 queries round to fp16 within attention's
        # range: the dots run in fp16, whose widening from e4m3 is one instruction per pair
        # (to bf16 it is several, and that, not the bytes, bounded the kernel).
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    tile = tl.arange(0, BLOCK_N)
    k_tile = k_cache_ptr + kv_head * stride_kh + tile[:, None] * stride_kt + dims[None, :]
    v_tile = v_cache_ptr + kv_head * stride_vh + tile[:, None] * stride_vt + dims[None, :]
    for key_start in range(lo, hi, BLOCK_N):
        keys = key_start + tile
        key_ok = keys < hi
        if WHOLE_PAGES:
            # The tile lies in one page (splits and tiles start at multiples of BLOCK_N): one
            # page number, added to a tile of addresses that the compiler sees as rows.
            page = tl.load(table + key_start // block_size).to(tl.int64)
            first = key_start % block_size
            k_ptrs = k_tile + (page * stride_kb + first * stride_kt)
            v_ptrs = v_tile + (page * stride_vb + first * stride_vt)
        else:
            # Gather per token: a tile may span several pages.
            page = tl.load(table + keys // block_size, mask=key_ok, other=0).to(tl.int64)
            offset = keys % block_size
            k_rows = page * stride_kb + offset * stride_kt + kv_head * stride_kh
            v_rows = page * stride_vb + offset * stride_vt + kv_head * stride_vh
            k_ptrs = k_cache_ptr + k_rows[:, None] + dims[None, :]
            v_ptrs = v_cache_ptr + v_rows[:, None] + dims[None, :]
        # An FP8 cache is widened to the dots' dtype: its K scale is in scale_log2.
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        s = tl.where(key_ok[None, :], s, float("-inf"))  # the tile's first key is always valid
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v)

    # An empty split (or context_len 0) leaves l_i = 0: write out 0 and LSE -inf, never NaN.
    # The output is linear in the values: their scale is applied once, here.
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    if SPLIT:
        num_splits = tl.num_programs(2)
        part = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [B, Hq, S]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=g_ok[:, None])
        # Base-2 LSE: the combine kernel stays in base 2.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_ok)
    else:
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


# The split count is a plain runtime value (not specialised on, and BLOCK_S fixed below), so one
# compiled variant serves every count: a step with a count not seen before compiles nothing.
@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the per-split softmax results of one (sequence, query head) by their LSE weights."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


# Flash-decoding: a decode step launches batch x Hkv programs. With fewer programs than SMs (a few
# long sequences) most of the GPU idles, so the key axis is cut into splits that run in parallel
# (about two waves of programs), and a second small kernel merges them. A split holds at least one
# full key tile. A few long sequences run several times faster split; once batch x Hkv >= SMs,
# splitting only adds work. Rules that split more (8 splits below two waves, or enough to fill the
# last wave) won on the kernel alone but lost inside the 32-layer decode graphs, whose sparse
# layers' short contexts gain nothing from splits and pay the merge kernel (docs/benchmarks.md,
# "Kernels and the decode roofline").
#
# An FP8 cache's programs (64-key tiles, 2 warps) run four at a time on an SM of the H200, so a
# launch takes ceil(programs / (4 x SMs)) waves, and a wave left part full idles what it leaves.
# Up to 3 x SMs programs (batch 49 at 8 KV heads), cutting every context into S splits makes S
# times as many programs of 1/S the work: the launch takes ceil(programs x S / wave) / S of the
# unsplit time, and the S that minimises it won at every batch measured, 1.1-1.9x on long
# contexts (docs/benchmarks.md). A split holds at least 512 keys of the longest context (more
# splits fill waves a little better, but each pays its merge), and from 1 x SMs programs on
# there are at most 4: more only tied on long contexts and lost on short ones. From 3 x SMs,
# unsplit. Never more than _MAX_SPLITS, which the merge kernel is compiled for.
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64
_FP8_PROGRAMS_PER_SM = 4
_FP8_MIN_TOKENS_PER_SPLIT = 512
_FP8_MAX_SPLITS_ABOVE_SMS = 4


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the split path
    return gpu_properties(device).multi_processor_count


def decode_num_splits(
    batch: int,
    num_kv_heads: int,
    max_context_len: int,
    device: torch.device,
    cache_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Key-axis splits for a decode step over a cache of `cache_dtype`."""
    return _num_splits(
        batch * num_kv_heads, _num_sms(device), max_context_len, cache_dtype == FP8_DTYPE
    )


@functools.lru_cache(maxsize=4096)
def _num_splits(programs: int, sms: int, max_context_len: int, fp8: bool) -> int:
    """decode_num_splits for `programs` unsplit programs on `sms` SMs (cached: eager steps ask
    once per layer, and the FP8 rule tries every count)."""
    if fp8:
        if programs >= 3 * sms:
            return 1
        wave = _FP8_PROGRAMS_PER_SM * sms
        most = min(_MAX_SPLITS, max(1, max_context_len // _FP8_MIN_TOKENS_PER_SPLIT))
        if programs >= sms:
            most = min(most, _FP8_MAX_SPLITS_ABOVE_SMS)
        # The fewest splits among those that take the least time.
        return min(range(1, most + 1), key=lambda s: (triton.cdiv(programs * s, wave) / s, s))
    if programs >= sms:
        return 1
    wanted = triton.cdiv(2 * sms, programs)
    useful = max(1, max_context_len // _MIN_TOKENS_PER_SPLIT)
    return min(wanted, useful, _MAX_SPLITS)


def _decode_tiles(q: torch.Tensor, cache_dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages) for the decode kernel.

    Long tiles keep many bytes in flight per program, which is what a bandwidth-bound kernel
    needs: 128 keys x 128 dims beat 64 keys unsplit and read long contexts near copy bandwidth
    (docs/benchmarks.md). Halved at D=256 to stay within shared memory. An FP8 cache is bound
    by its widening more than by its bytes: half the keys per tile and two warps per program,
    so that more programs share each SM and hide each other's latency.
    """
    if not q.is_cuda:
        return 16, 4, 1
    block_n = 128 if q.shape[-1] <= 128 else 64
    if cache_dtype == FP8_DTYPE:
        return block_n // 2, 2, 2
    return block_n, 4, 2


class NewKeys(NamedTuple):
    """A decode step's own tokens, one per sequence, for `rotate_store_and_decode`: keys and
    values [B, Hkv, D] before RoPE, positions [B], the RoPE tables, and their slots [B]."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_scales: KVScales = UNIT_SCALES,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context: q [B, Hq, D] -> out [B, Hq, D].

    block_tables [B, max_blocks] (int32, padded), context_lens [B]. Any page size works; with
    pages of a multiple of the key tile (128 keys on a GPU at D <= 128) each tile is read from
    one page number, faster than a gather per token (docs/benchmarks.md). `max_context_len`
    (an upper bound is enough) only chooses the number of splits, without a device-to-host
    sync, so the launch can be captured in a CUDA graph; every split count reads each whole
    context. `out`: where to write the output (default: a new tensor; its head dim must be
    contiguous). `kv_scales`: an FP8 cache's scales.
    """
    return _paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, out, kv_scales,
        num_splits,
    )  # fmt: skip


def rotate_store_and_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_scales: KVScales = UNIT_SCALES,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`rotate_and_store_kv` of the decode rows (q [B, Hq, D], k and v [B, Hkv, D], one token
    per sequence), then `paged_decode_attention` over contexts that include those tokens.

    One launch when the keys are not split (every decode step from batch x Hkv >= SMs, where a
    separate launch of the store costs as much as its work); with splits, the
    programs of one sequence would race on its new key, so it is stored in a launch first.
    """
    new = NewKeys(k, v, positions, cos, sin, slot_mapping)
    return _paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, out, kv_scales,
        num_splits, new,
    )  # fmt: skip


def _paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None,
    out: torch.Tensor | None,
    kv_scales: KVScales,
    num_splits: int | None,
    new: NewKeys | None = None,
) -> torch.Tensor:
    batch, num_q, head_dim = q.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    check_head_dim(head_dim)
    assert num_q % num_kv == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1 and context_lens.is_contiguous()
    assert k_cache.dtype == v_cache.dtype
    if new is not None:
        new_k, new_v, positions, cos, sin, slots = new
        _check_rotate_and_store(q, new_k, new_v, positions, cos, sin, k_cache, v_cache, slots)
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    if batch == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv, max_context_len, q.device, k_cache.dtype)
    block_n, num_warps, num_stages = _decode_tiles(q, k_cache.dtype)
    split = num_splits > 1
    if new is not None and split:
        rotate_and_store_kv(
            q, new.k, new.v, new.positions, new.cos, new.sin, k_cache, v_cache, new.slot_mapping,
            kv_scales,
        )  # fmt: skip
        new = None
    group = num_q // num_kv
    if split:
        part_out = torch.empty(
            batch, num_q, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(batch, num_q, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused when SPLIT is off
    # Without new keys, their pointers are never read: any tensor stands in.
    k_new, v_new, positions, cos, sin, slots = new if new is not None else (q,) * 6
    launch(
        _paged_decode_kernel, (batch, num_kv, num_splits),
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        k_new, v_new, positions, cos, sin, slots,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0),
        scale * LOG2E * kv_scales.k, kv_scales.v, 1.0 / kv_scales.k, 1.0 / kv_scales.v,
        block_size, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim, BLOCK_N=block_n, SPLIT=split, WHOLE_PAGES=block_size % block_n == 0,
        ROTATE_STORE=new is not None, **early_launch(q), **_launch_options(q, num_warps, num_stages),
    )  # fmt: skip
    if split:
        launch(
            _combine_splits_kernel, (batch, num_q),
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=max(_MAX_SPLITS, triton.next_power_of_2(num_splits)),
            **_launch_options(q, 4, 1),
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# 3b. Token selection: pooling, top-k and the kept rows in one launch
#
# The same selection in torch (`reference.select_kept_rows`) is ~28 small ops per layer, whose
# host time made a compressing step host-bound; this kernel (one program per prompt and KV head)
# also takes less device time than torch's two sorts (docs/benchmarks.md).
# ---------------------------------------------------------------------------------------------

_POOLING = {"none": 0, "avg": 1, "max": 2}


@triton.jit
def _order_keys(pooled, selectable):
    """uint32 keys that order as the floats do; 0 (below every float) where not selectable."""
    pooled = tl.where(pooled == 0.0, 0.0, pooled)  # -0.0 becomes 0.0, which it equals
    bits = pooled.to(tl.uint32, bitcast=True)
    keys = tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(selectable, keys, 0)


# window and sinks are arguments, not constexprs, and each prompt's budget is read from memory:
# layer groups and prompts of different budgets share one compiled kernel.
@triton.jit(
    do_not_specialize=[
        "stride_sp", "stride_sh", "stride_kp", "stride_kh", "stride_oh", "window", "sinks"
    ]
)  # fmt: skip
def _select_kept_kernel(
    scores_ptr,
    scored_lens_ptr,
    starts_ptr,
    kept_offsets_ptr,
    keys_ptr,
    out_ptr,
    stride_sp,
    stride_sh,
    stride_kp,
    stride_kh,
    stride_oh,
    window,
    sinks,
    POOLING: tl.constexpr,  # 0 none, 1 avg, 2 max
    KERNEL_SIZE: tl.constexpr,
    SINKS_BLOCK: tl.constexpr,
    WINDOW_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (prompt, KV head): its `budget` kept rows (the difference of its kept
    offsets), ascending, into out[head] from its first offset.

    1. Pool the scores (as `reference.select_kept_rows`: over real tokens only) into a row of
       order-preserving uint32 keys, sinks and padding set to 0.
    2. Radix-select the (budget - window - sinks)-th largest key, 8 bits per pass, with a
       histogram of the keys that share the bits found so far.
    3. Write the sinks, every key above that threshold and, in token order, as many keys equal
       to it as are still needed (ties go to the earlier token, as a stable sort's would), then
       the window.
    """
    prompt = tl.program_id(0)
    head = tl.program_id(1)
    num_scored = tl.load(scored_lens_ptr + prompt)
    start = tl.load(starts_ptr + prompt)
    first_kept = tl.load(kept_offsets_ptr + prompt)
    budget = (tl.load(kept_offsets_ptr + prompt + 1) - first_kept).to(tl.int32)
    scores = scores_ptr + prompt * stride_sp + head * stride_sh
    keys_row = keys_ptr + prompt * stride_kp + head * stride_kh
    out = out_ptr + head * stride_oh + first_kept
    offs = tl.arange(0, BLOCK)

    for first in range(0, num_scored, BLOCK):
        idx = first + offs
        if POOLING == 0:
            pooled = tl.load(scores + idx, mask=idx < num_scored, other=0.0)
        else:
            total = tl.zeros([BLOCK], tl.float32)
            if POOLING == 2:
                total = tl.full([BLOCK], float("-inf"), tl.float32)
            count = tl.zeros([BLOCK], tl.float32)
            for d in tl.static_range(KERNEL_SIZE):
                j = idx + d - KERNEL_SIZE // 2
                ok = (j >= 0) & (j < num_scored)
                if POOLING == 1:
                    total += tl.load(scores + j, mask=ok, other=0.0)
                    count += ok.to(tl.float32)
                else:
                    total = tl.maximum(total, tl.load(scores + j, mask=ok, other=float("-inf")))
            pooled = total
            if POOLING == 1:  # the reference's avg_pool1d sums and counts, divided
                pooled = (total / KERNEL_SIZE) / tl.maximum(count / KERNEL_SIZE, 1e-9)
        keys = _order_keys(pooled, (idx >= sinks) & (idx < num_scored))
        tl.store(keys_row + idx, keys.to(tl.int32, bitcast=True), mask=idx < num_scored)
    tl.debug_barrier()  # the keys are read back by other threads of the program

    need = tl.zeros([], tl.int32) + (budget - window - sinks)  # keys still to pick
    prefix = tl.zeros([], tl.uint32)  # the threshold's bits found so far
    bins = tl.arange(0, 256)
    for shift in tl.static_range(24, -1, -8):
        hist = tl.zeros([256], tl.int32)
        for first in range(0, num_scored, BLOCK):
            idx = first + offs
            keys = tl.load(keys_row + idx, mask=idx < num_scored, other=0)
            keys = keys.to(tl.uint32, bitcast=True)
            same_high = ((keys >> shift) >> 8) == ((prefix >> shift) >> 8)
            digits = ((keys >> shift) & 255).to(tl.int32)
            hist += tl.histogram(digits, 256, mask=(idx < num_scored) & same_high)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this digit or above
        digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
        need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)

    sink_offs = tl.arange(0, SINKS_BLOCK)
    tl.store(out + sink_offs, start + sink_offs, mask=sink_offs < sinks)
    written = tl.zeros([], tl.int32) + sinks
    ties_seen = tl.zeros([], tl.int32)
    for first in range(0, num_scored, BLOCK):
        idx = first + offs
        valid = idx < num_scored
        keys = tl.load(keys_row + idx, mask=valid, other=0).to(tl.uint32, bitcast=True)
        tie = (valid & (keys == prefix)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, 0) - tie
        take = ((valid & (keys > prefix)) | ((tie == 1) & (tie_rank < need))).to(tl.int32)
        position = written + tl.cumsum(take, 0) - take
        tl.store(out + position, start + idx, mask=take == 1)
        written += tl.sum(take, 0)
        ties_seen += tl.sum(tie, 0)
    window_offs = tl.arange(0, WINDOW_BLOCK)
    tl.store(
        out + budget - window + window_offs,
        start + num_scored + window_offs,
        mask=window_offs < window,
    )


def select_kept_rows(
    scores: list[torch.Tensor],
    scored_lens: torch.Tensor,
    starts: torch.Tensor,
    kept_offsets: torch.Tensor,
    kept: list[int],
    window: int,
    sinks: int,
    pooling: str,
    kernel_size: int,
) -> torch.Tensor:
    """Kept rows per KV head, int64 [Hkv, sum(kept)]; see `reference.select_kept_rows`.

    scores: per prompt float32 [Hkv, n_j - window]; scored_lens [S], starts [S] and
    kept_offsets [S + 1] int64.
    """
    if pooling not in _POOLING:
        raise ValueError(f"unknown pooling {pooling!r}; expected 'avg', 'max' or 'none'")
    num_kv, device = scores[0].shape[0], scores[0].device
    padded = reference.pad_scores(scores)  # the kernel reads no row past its prompt's length
    assert padded.stride(-1) == 1 and starts.dtype == torch.int64
    # The kernel reads prompt j's values at offset j: strided views would be read wrong.
    assert (
        starts.is_contiguous() and scored_lens.is_contiguous() and kept_offsets.is_contiguous()
    ), "starts, scored_lens and kept_offsets must be contiguous"
    keys = torch.empty(padded.shape, dtype=torch.int32, device=device)
    out = torch.empty(num_kv, sum(kept), dtype=torch.int64, device=device)
    # 1,024 keys per tile: a 4,000-token prompt in 4 tiles per pass; the interpreter gets 16.
    block = 1024 if padded.is_cuda else 16
    launch(
        _select_kept_kernel, (len(scores), num_kv),
        padded, scored_lens, starts, kept_offsets, keys, out,
        padded.stride(0), padded.stride(1), keys.stride(0), keys.stride(1), out.stride(0),
        window, sinks,
        POOLING=_POOLING[pooling] if kernel_size > 1 else 0, KERNEL_SIZE=kernel_size,
        SINKS_BLOCK=triton.next_power_of_2(max(sinks, 1)),
        WINDOW_BLOCK=triton.next_power_of_2(max(window, 1)),
        BLOCK=block,
        **_launch_options(padded, 4, 1),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# 4-5. Moving tokens: store into the paged cache, gather kept tokens, fused compaction
# ---------------------------------------------------------------------------------------------


@triton.jit
def _copy_rows(src_ptr, dst_ptr, src_off, dst_off, ok, factor, HEAD_DIM: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.load(src_ptr + src_off[:, None] + dims[None, :], mask=ok[:, None])
    dst = dst_ptr + dst_off[:, None] + dims[None, :]
    tl.store(dst, _to_cache(rows, factor, dst_ptr), mask=ok[:, None])


@triton.jit(do_not_specialize=["num_rows", "stride_ih"])  # see _window_scores_kernel
def _move_tokens_kernel(
    src_k_ptr,
    src_v_ptr,
    dst_k_ptr,
    dst_v_ptr,
    indices_ptr,
    slots_ptr,
    num_rows,
    stride_sk_t,
    stride_sk_h,
    stride_sv_t,
    stride_sv_h,
    stride_dk_b,
    stride_dk_t,
    stride_dk_h,
    stride_dv_b,
    stride_dv_t,
    stride_dv_h,
    stride_ih,
    dst_block_size,
    k_factor,
    v_factor,
    HAS_V: tl.constexpr,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Row j of KV head h: dst[slot_j, h] = src[index_{h,j}, h] * factor.

    index_{h,j} = indices[h, j] when GATHER, else j; slot_j = slots[j] when SCATTER (-1 skips),
    else j. The destination is paged [blocks, dst_block_size, H, D]; a plain [R, H, D] tensor is
    passed as pages of one token.
    """
    row_block = tl.program_id(0)
    head = tl.program_id(1)
    j = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = j < num_rows
    if GATHER:
        src_row = tl.load(indices_ptr + head * stride_ih + j, mask=ok, other=0).to(tl.int64)
    else:
        src_row = j.to(tl.int64)
    if SCATTER:
        slot = tl.load(slots_ptr + j, mask=ok, other=-1).to(tl.int64)
        ok = ok & (slot >= 0)
    else:
        slot = j.to(tl.int64)
    page = slot // dst_block_size
    offset = slot % dst_block_size
    _copy_rows(
        src_k_ptr, dst_k_ptr,
        src_row * stride_sk_t + head * stride_sk_h,
        page * stride_dk_b + offset * stride_dk_t + head * stride_dk_h,
        ok, k_factor, HEAD_DIM,
    )  # fmt: skip
    if HAS_V:
        _copy_rows(
            src_v_ptr, dst_v_ptr,
            src_row * stride_sv_t + head * stride_sv_h,
            page * stride_dv_b + offset * stride_dv_t + head * stride_dv_h,
            ok, v_factor, HEAD_DIM,
        )  # fmt: skip


def _move_tokens(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    num_rows: int,
    src_v: torch.Tensor | None = None,
    dst_v: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """Launch `_move_tokens_kernel`: src [n, H, D] / kv_scales -> paged dst [blocks, block_size,
    H, D]."""
    head_dim, num_heads = src_k.shape[-1], src_k.shape[1]
    check_head_dim(head_dim)
    assert src_k.stride(-1) == dst_k.stride(-1) == 1, "head dim must be contiguous"
    if num_rows == 0:
        return
    assert slots is None or slots.is_contiguous()
    has_v = src_v is not None
    src_v = src_v if has_v else src_k
    dst_v = dst_v if has_v else dst_k
    assert src_v.stride(-1) == dst_v.stride(-1) == 1, "head dim must be contiguous"
    # 32 rows x D per program: big enough to stream, small enough for many programs per SM.
    block_r = 32 if src_k.is_cuda else 16
    grid = (triton.cdiv(num_rows, block_r), num_heads)
    launch(
        _move_tokens_kernel, grid,
        src_k, src_v, dst_k, dst_v,
        indices if indices is not None else src_k,  # unused pointer when not GATHER
        slots if slots is not None else src_k,  # unused pointer when not SCATTER
        num_rows,
        src_k.stride(0), src_k.stride(1), src_v.stride(0), src_v.stride(1),
        dst_k.stride(0), dst_k.stride(1), dst_k.stride(2),
        dst_v.stride(0), dst_v.stride(1), dst_v.stride(2),
        indices.stride(0) if indices is not None else 0,
        dst_k.shape[1], 1.0 / kv_scales.k, 1.0 / kv_scales.v,
        HAS_V=has_v, GATHER=indices is not None, SCATTER=slots is not None,
        HEAD_DIM=head_dim, BLOCK_R=block_r,
        **_launch_options(src_k, 4, 1),
    )  # fmt: skip


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """Write k / kv_scales.k and v / kv_scales.v [T, Hkv, D] into the paged caches at
    `slot_mapping` [T]; slot -1 is skipped."""
    _move_tokens(
        k, k_cache, k.shape[0], src_v=v, dst_v=v_cache, slots=slot_mapping, kv_scales=kv_scales
    )


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [n, Hkv, D], indices [Hkv, B] -> [B, Hkv, D] with out[j, h] = x[indices[h, j], h]."""
    assert indices.stride(-1) == 1
    num_kept = indices.shape[1]
    out = torch.empty(num_kept, *x.shape[1:], dtype=x.dtype, device=x.device)
    _move_tokens(x, out.unsqueeze(1), num_kept, indices=indices)
    return out


def store_selected_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """Compaction in one kernel: cache[slot_mapping[j], h] = k/v[indices[h, j], h] / kv_scales
    (`kv_scales.inverse()` dequantizes a copy out of an FP8 cache).

    k, v [n, Hkv, D] hold a prompt's keys and values (e.g. a prefill scratch buffer); indices
    [Hkv, B] are the kept tokens per head (from `select_kept_rows`); slot_mapping [B] the paged
    slots of the B kept positions (-1 skips).
    """
    assert indices.stride(-1) == 1
    _move_tokens(
        k, k_cache, indices.shape[1], src_v=v, dst_v=v_cache, indices=indices, slots=slot_mapping,
        kv_scales=kv_scales,
    )  # fmt: skip

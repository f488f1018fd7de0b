"""Plain-torch kernels: the CPU path of the engine and the oracle for the Triton kernels.

Layouts (T = tokens in a step, Hq / Hkv = query / KV heads, D = head dim):
- varlen prefill tensors are packed: q [T, Hq, D], k and v [T, Hkv, D], with `cu_seqlens`
  (int32, [num_seqs + 1]) giving each sequence's start offset;
- a paged cache is [num_blocks, block_size, Hkv, D]; a slot is `block * block_size + offset`;
- LSE is the natural-log log-sum-exp of a query row's scaled logits, float32 [Hq, T];
- a cache may be FP8 e4m3: it holds k / kv_scales.k and v / kv_scales.v (`fp8.KVScales`), and
  every kernel that reads it multiplies back (in float32) before computing.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from sparse_core.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    UNIT_SCALES,
    FP8Rows,
    KVScales,
    quantize_activations,
)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    cu_seqlens_k: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each packed sequence; returns (out [T, Hq, D], lse [Hq, T]).

    `cu_seqlens_k` (default: `cu_seqlens`) packs the keys apart from the queries: a sequence may
    have more keys than queries, its queries being its last tokens (a prompt chunk after the
    chunks already cached). `out`: where to write the output (default: a new tensor).
    `sliding_window`: each query sees only the last that many keys (itself included).
    Materialises each sequence's logits: use it as an oracle and for short sequences.
    """
    num_q, num_kv = q.shape[1], k.shape[1]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(num_q, q.shape[0], dtype=torch.float32, device=q.device)
    for (start, end), (k_start, k_end) in _query_and_key_bounds(cu_seqlens, cu_seqlens_k):
        qs = q[start:end].float().transpose(0, 1)  # [Hq, n, D]
        ks = k[k_start:k_end].float().transpose(0, 1).repeat_interleave(num_q // num_kv, dim=0)
        vs = v[k_start:k_end].float().transpose(0, 1).repeat_interleave(num_q // num_kv, dim=0)
        logits = torch.matmul(qs, ks.transpose(1, 2)) * scale
        visible = _causal_mask(end - start, k_end - k_start, q.device, sliding_window)
        logits = logits.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # [Hq, n]
        probs = torch.exp(logits - row_lse.unsqueeze(-1))
        out[start:end] = torch.matmul(probs, vs).transpose(0, 1).to(q.dtype)
        lse[:, start:end] = row_lse
    return out, lse


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    cu_seqlens_k: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`prefill_attention` without LSE, through torch's fused SDPA.

    The fast CPU path: memory stays linear in the sequence length (a sequence with more keys
    than queries passes a [queries, keys] mask).
    """
    out = torch.empty_like(q) if out is None else out
    for (start, end), (k_start, k_end) in _query_and_key_bounds(cu_seqlens, cu_seqlens_k):
        qs = q[start:end].transpose(0, 1).unsqueeze(0)
        ks, vs = (x[k_start:k_end].transpose(0, 1).unsqueeze(0) for x in (k, v))
        num_keys = k_end - k_start
        if num_keys == end - start and (sliding_window is None or sliding_window >= num_keys):
            mask, causal = None, True
        else:  # SDPA's is_causal aligns the mask top-left; these queries are the last tokens
            mask = _causal_mask(end - start, num_keys, q.device, sliding_window)
            causal = False
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


def _query_and_key_bounds(
    cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor | None
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    q_bounds = itertools.pairwise(cu_seqlens.tolist())
    k_bounds = itertools.pairwise((cu_seqlens if cu_seqlens_k is None else cu_seqlens_k).tolist())
    return list(zip(q_bounds, k_bounds, strict=True))


def _causal_mask(
    num_queries: int, num_keys: int, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """[queries, keys]: query i (the sequence's token num_keys - num_queries + i) sees keys up to
    itself, and with a sliding window only the last that many of them."""
    ones = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    visible = ones.tril(num_keys - num_queries)
    if sliding_window is not None:
        visible &= ones.triu(num_keys - num_queries - sliding_window + 1)
    return visible


def window_lse(q_win: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """LSE [Hq, w] of the last w queries of one sequence (q_win [w, Hq, D], k [n, Hkv, D]).

    Used where the attention kernel did not emit LSE (the CPU SDPA path); costs w·n.
    """
    w, n = q_win.shape[0], k.shape[0]
    logits = _window_logits(q_win, k, scale)  # [Hq, w, n]
    q_pos = torch.arange(n - w, n, device=k.device).unsqueeze(1)
    visible = torch.arange(n, device=k.device).unsqueeze(0) <= q_pos
    return torch.logsumexp(logits.masked_fill(~visible, float("-inf")), dim=-1)


def window_scores(
    q_win: torch.Tensor,
    k: torch.Tensor,
    lse_win: torch.Tensor,
    scale: float,
    gqa_reduce: str = "mean",
) -> torch.Tensor:
    """Attention that prompt keys [0, n - w) receive from the w window queries, per KV head.

    q_win [w, Hq, D] are the last w queries of one sequence of n tokens, k [n, Hkv, D] its keys,
    lse_win [Hq, w] the window rows' LSE. Every window query sees every scored key, so no mask.
    S[h, i] = reduce_{qh in group(h)} sum_q exp(q·k_i·scale − LSE[qh, q]); returns float32 [Hkv, n − w].
    """
    w, num_q = q_win.shape[0], q_win.shape[1]
    num_kv = k.shape[1]
    n = k.shape[0]
    logits = _window_logits(q_win, k[: n - w], scale)  # [Hq, w, n - w]
    per_query_head = torch.exp(logits - lse_win.float().unsqueeze(-1)).sum(dim=1)  # [Hq, n - w]
    grouped = per_query_head.view(num_kv, num_q // num_kv, n - w)
    if gqa_reduce == "mean":
        return grouped.mean(dim=1)
    if gqa_reduce == "max":
        return grouped.amax(dim=1)
    raise ValueError(f"unknown gqa_reduce {gqa_reduce!r}; expected 'mean' or 'max'")


def _window_logits(q_win: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    num_q, num_kv = q_win.shape[1], k.shape[1]
    qs = q_win.float().transpose(0, 1)  # [Hq, w, D]
    ks = k.float().transpose(0, 1).repeat_interleave(num_q // num_kv, dim=0)  # [Hq, n, D]
    return torch.matmul(qs, ks.transpose(1, 2)) * scale


def pool_scores(scores: torch.Tensor, pooling: str, kernel_size: int) -> torch.Tensor:
    """Smooth scores [Hkv, m] over neighbouring tokens (odd kernel, same length out)."""
    if pooling == "none" or kernel_size <= 1:
        return scores
    x = scores.unsqueeze(0)
    pad = kernel_size // 2
    if pooling == "avg":
        # count_include_pad=False so the edges are averaged over real tokens only.
        return F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=False)[0]
    if pooling == "max":
        return F.max_pool1d(x, kernel_size, stride=1, padding=pad)[0]
    raise ValueError(f"unknown pooling {pooling!r}; expected 'avg', 'max' or 'none'")


def select_top_tokens(
    pooled: torch.Tensor, n: int, budget: int, window: int, sinks: int
) -> torch.Tensor:
    """Kept token indices per KV head, int64 [Hkv, budget], ascending.

    pooled [Hkv, n − window] scores the non-window tokens; the first `sinks` tokens and the last
    `window` tokens are always kept; the rest of the budget goes to the highest-scoring tokens.
    """
    num_kv = pooled.shape[0]
    device = pooled.device
    num_top = budget - window - sinks
    middle = pooled[:, sinks : n - window]
    top = top_indices(middle, num_top) + sinks
    forced = torch.cat(
        [torch.arange(sinks, device=device), torch.arange(n - window, n, device=device)]
    )
    kept = torch.cat([forced.unsqueeze(0).expand(num_kv, -1), top], dim=-1)
    return kept.sort(dim=-1).values


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last axis; ties go to the earlier token (max
    pooling makes ties common, and a fixed rule keeps batched and single selection equal)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


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
    """Pool, then keep sinks + window + the best of the rest, for several prompts at once.

    scores: per prompt, float32 [Hkv, n_j - window] (its non-window tokens); scored_lens [S] the
    same lengths on the device; starts [S] each prompt's first row among the packed keys;
    kept: the tokens prompt j keeps (each fewer than n_j), and kept_offsets [S + 1] their
    running sums on the device. Returns int64 [Hkv, sum(kept)]: prompt j's kept rows (its token
    indices + starts[j]), ascending, in the columns from kept_offsets[j]. The batched twin of
    `pool_scores` + `select_top_tokens` (their test oracle): prompts of different lengths are
    padded, and padding takes part in nothing. Ties go to the earlier token, as in
    `top_indices`.
    """
    num_kv, device = scores[0].shape[0], scores[0].device
    padded = pad_scores(scores)
    index = torch.arange(padded.shape[-1], device=device)
    scored = index < scored_lens.unsqueeze(1)  # [S, width]: real, non-window tokens
    pooled = _pool_padded(padded, scored, pooling, kernel_size)
    selectable = scored & (index >= sinks)
    pooled = pooled.masked_fill(~selectable.unsqueeze(1), float("-inf"))
    num_top = max(kept) - window - sinks
    # The best of every prompt, by score; prompt j takes its first kept_j - window - sinks.
    top = top_indices(pooled, num_top)
    taken = torch.arange(num_top, device=device) < (kept_offsets.diff() - window - sinks)[:, None]
    top = top.masked_fill(~taken.unsqueeze(1), torch.iinfo(torch.int64).max)  # sorted last
    forced = torch.cat(
        [
            torch.arange(sinks, device=device).expand(len(scores), -1),
            scored_lens.unsqueeze(1) + torch.arange(window, device=device),
        ],
        dim=1,
    )
    chosen = torch.cat([forced.unsqueeze(1).expand(-1, num_kv, -1), top], dim=-1)
    return ragged_rows(chosen.sort(dim=-1).values, kept_offsets, sum(kept), starts)


def pad_scores(scores: list[torch.Tensor]) -> torch.Tensor:
    """Per-prompt scores [Hkv, n_j] -> [S, Hkv, max n_j], zero-padded (one prompt: a view)."""
    if len(scores) == 1:
        return scores[0].unsqueeze(0)
    padded = scores[0].new_zeros(len(scores), scores[0].shape[0], max(s.shape[1] for s in scores))
    for i, s in enumerate(scores):
        padded[i, :, : s.shape[1]] = s
    return padded


def ragged_rows(
    kept: torch.Tensor, kept_offsets: torch.Tensor, total: int, starts: torch.Tensor
) -> torch.Tensor:
    """Kept token indices [S, Hkv, B] of S packed prompts, prompt j's in its first
    kept_offsets[j + 1] - kept_offsets[j] columns -> their rows among the packed keys, per KV
    head: [Hkv, total], prompt j's in the columns from kept_offsets[j]. Without a device sync:
    `total` (the last offset) comes from the host."""
    counts = kept_offsets.diff()
    prompt = torch.repeat_interleave(
        torch.arange(len(counts), device=kept.device), counts, output_size=total
    )
    column = torch.arange(total, device=kept.device) - kept_offsets[prompt]
    return kept.transpose(0, 1)[:, prompt, column] + starts[prompt]


def _pool_padded(scores: torch.Tensor, valid: torch.Tensor, pooling: str, kernel_size: int):
    """Pool [S, Hkv, width] over tokens where `valid` [S, width]; the window never crosses into
    padding (like count_include_pad=False at a sequence's end)."""
    if pooling == "none" or kernel_size <= 1:
        return scores
    pad = kernel_size // 2
    flat = scores.flatten(0, 1).unsqueeze(1)  # [S * Hkv, 1, width]
    mask = valid.unsqueeze(1).expand_as(scores).flatten(0, 1).unsqueeze(1).float()
    if pooling == "avg":
        sums = F.avg_pool1d(flat * mask, kernel_size, 1, pad, count_include_pad=True)
        counts = F.avg_pool1d(mask, kernel_size, 1, pad, count_include_pad=True)
        return (sums / counts.clamp_min(1e-9)).view_as(scores)
    if pooling == "max":
        filled = flat.masked_fill(mask == 0, float("-inf"))
        return F.max_pool1d(filled, kernel_size, 1, pad).view_as(scores)
    raise ValueError(f"unknown pooling {pooling!r}")


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [n, Hkv, D], indices [Hkv, B] -> [B, Hkv, D] with out[j, h] = x[indices[h, j], h]."""
    idx = indices.t().unsqueeze(-1).expand(-1, -1, x.shape[-1])
    if x.dtype == FP8_DTYPE:  # torch has no gather for it: move the bytes
        return torch.gather(x.view(torch.uint8), 0, idx).view(FP8_DTYPE)
    return torch.gather(x, 0, idx)


def to_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype`, computed in float32; into FP8, saturated to e4m3's range (an
    outlier is clipped, never turned into NaN)."""
    if scale == 1.0 and x.dtype == dtype:
        return x
    y = x.float() * (1.0 / scale)
    if dtype == FP8_DTYPE:
        y = y.clamp(-FP8_MAX, FP8_MAX)
    return y.to(dtype)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """Write k / kv_scales.k and v / kv_scales.v ([T, Hkv, D]) into the paged caches at
    `slot_mapping` [T], in the caches' dtype; slot -1 = skip."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache(k[keep], kv_scales.k, k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache(v[keep], kv_scales.v, v_cache.dtype)


def store_selected_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_SCALES,
) -> None:
    """Compaction: cache[slot_mapping[j], h] = k/v[indices[h, j], h] / kv_scales for the kept
    tokens (`kv_scales.inverse()` dequantizes a copy out of an FP8 cache)."""
    store_kv(
        gather_tokens(k, indices), gather_tokens(v, indices), k_cache, v_cache, slot_mapping,
        kv_scales,
    )  # fmt: skip


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
) -> torch.Tensor:
    """One query per sequence over its paged context: q [B, Hq, D] -> out [B, Hq, D].

    block_tables [B, max_blocks] (int32, padded), context_lens [B] (tokens in the cache, including
    the one written this step); `max_context_len`, a bound on context_lens, spares a host sync.
    `out`: where to write the output (default: a new tensor). `kv_scales`: what the cached keys
    and values are multiplied by (an FP8 cache's scales).
    """
    batch, num_q, head_dim = q.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max()) if max_context_len is None else max_context_len
    num_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()
    # [B, num_blocks * block_size, Hkv, D]: each sequence's context, padded to max_len.
    keys = k_cache[tables].flatten(1, 2)[:, :max_len]
    values = v_cache[tables].flatten(1, 2)[:, :max_len]
    group = num_q // num_kv
    qs = q.float().view(batch, num_kv, group, head_dim)
    logits = torch.einsum("bhgd,blhd->bhgl", qs, keys.float()) * (scale * kv_scales.k)
    valid = torch.arange(max_len, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1).long()
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    result = torch.einsum("bhgl,blhd->bhgd", probs, values.float()) * kv_scales.v
    result = result.reshape(batch, num_q, head_dim).to(q.dtype)
    return result if out is None else out.copy_(result)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual, the second is x.

    Rounds like Hugging Face's LlamaRMSNorm: normalise in float32, back to x's dtype, then scale
    (in the weight's dtype where it is wider, Gemma's float32, and back to x's).
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype), x


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[FP8Rows, torch.Tensor]:
    """`rms_norm` with its output quantized for an FP8 linear layer (`quantize_activations`)."""
    normed, residual_out = rms_norm(x, weight, eps, residual)
    return quantize_activations(normed), residual_out


# The MLP gate activations: Llama's, and Gemma's GELU (its tanh approximation).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {ACTIVATIONS}")


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> act(gate) * up."""
    check_activation(activation)
    gate, up = x.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def act_and_mul_fp8(x: torch.Tensor, activation: str = "silu") -> FP8Rows:
    """`act_and_mul` with its output quantized for an FP8 linear layer."""
    return quantize_activations(act_and_mul(x, activation))


def apply_rotary_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate, in place, the heads of x [T, H, D] by their tokens' positions (the rotate-half
    convention of HF Llama); cos/sin [max_pos, D / 2]."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))


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
    """RoPE applied in place to q [T, Hq, D] and k [T, Hkv, D], then k and v [T, Hkv, D]
    written into the paged caches at `slot_mapping` [T] (slot -1 is skipped), as `store_kv`."""
    apply_rotary_(q, positions, cos, sin)
    apply_rotary_(k, positions, cos, sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)


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
) -> torch.Tensor:
    """A decode step's attention: `rotate_and_store_kv` of its rows (one token per sequence),
    then `paged_decode_attention` over contexts that include those tokens."""
    rotate_and_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, kv_scales)
    return paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, out, kv_scales
    )

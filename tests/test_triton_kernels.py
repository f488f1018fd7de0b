"""Triton kernels against the plain-torch reference (the oracle).

Without CUDA the kernels run on CPU under Triton's interpreter at tiny shapes (tests/triton_setup.py);
with CUDA the same small cases run compiled, and the `gpu` tests add realistic shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from sparse_core.config import SparsityConfig
from sparse_core.kernels import REFERENCE_OPS
from sparse_core.kernels import reference as ref
from sparse_core.kernels.fp8 import FP8_DTYPE, FP8_MAX, UNIT_SCALES, KVScales
from sparse_core.models.attention import ChunkContext
from sparse_core.selection import PromptBatch, selection_policy
from tests.triton_setup import DEVICE, HAS_CUDA, import_kernels

tk = import_kernels("sparse_core.kernels.triton_kernels")

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

# (atol, rtol) for outputs in the input dtype; LSE and scores are float32 in both implementations
# and only differ by summation order (plus bf16/fp16 rounding of P in the kernels' P @ V).
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _randn(*shape: int, dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def _packed(seq_lens: list[int], num_q: int, num_kv: int, head_dim: int, dtype: torch.dtype):
    total = sum(seq_lens)
    q = _randn(total, num_q, head_dim, dtype=dtype)
    k = _randn(total, num_kv, head_dim, dtype=dtype)
    v = _randn(total, num_kv, head_dim, dtype=dtype)
    cu = torch.tensor(
        [0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    return q, k, v, cu


def _paged(
    context_lens: list[int],
    num_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    spare_blocks: int = 3,
):
    """Random paged caches with a shuffled block table (padded with -1 past each context)."""
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = _randn(num_blocks, block_size, num_kv, head_dim, dtype=dtype)
    v_cache = _randn(num_blocks, block_size, num_kv, head_dim, dtype=dtype)
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(context_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    for i, count in enumerate(blocks_per_seq):
        table[i, :count] = torch.tensor([order.pop() for _ in range(count)])
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, table.to(DEVICE), lens


# --- prefill attention -----------------------------------------------------------------------


class _CountedDescriptors:
    """Stands in for TensorDescriptor in the kernel module, counting the descriptors made."""

    def __init__(self) -> None:
        self.made = 0

    def from_tensor(self, *args, **kwargs):
        self.made += 1
        return _TENSOR_DESCRIPTOR.from_tensor(*args, **kwargs)


_TENSOR_DESCRIPTOR = tk.TensorDescriptor


@pytest.fixture
def descriptors(monkeypatch: pytest.MonkeyPatch) -> _CountedDescriptors:
    counted = _CountedDescriptors()
    monkeypatch.setattr(tk, "TensorDescriptor", counted)
    return counted


@pytest.fixture(params=["tma", "pointers"])
def key_loads(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    descriptors: _CountedDescriptors,
):
    """The prefill kernel reading keys and values through TMA descriptors (checked to be made),
    then by pointers (what GPUs before Hopper run)."""
    if request.param == "pointers":
        monkeypatch.setattr(tk, "_tma_supported", lambda device: False)
    elif not tk._tma_supported(torch.device(DEVICE)):
        pytest.skip("this GPU has no TMA")
    yield request.param
    assert (descriptors.made > 0) == (request.param == "tma")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_q,num_kv", [(2, 2), (4, 2), (8, 2)])
def test_prefill_attention_matches_reference(
    num_q: int, num_kv: int, dtype: torch.dtype, key_loads: str
) -> None:
    torch.manual_seed(num_q + 10 * num_kv)
    # Several packed sequences: odd lengths, one shorter than a tile, one spanning several tiles.
    q, k, v, cu = _packed([37, 5, 70, 1], num_q, num_kv, 32, dtype)
    out, lse = tk.prefill_attention(q, k, v, cu, scale=0.3)
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu, scale=0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _close(out, ref_out, dtype)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_prefill_attention_on_views_of_fused_qkv(key_loads: str) -> None:
    """As the model calls it: q, k and v are column slices of one [T, (Hq + 2 Hkv) * D]
    projection, so every token's keys are a row apart from the next's."""
    torch.manual_seed(4)
    num_q, num_kv, head_dim, lens = 4, 2, 32, [23, 50]
    qkv = _randn(sum(lens), (num_q + 2 * num_kv) * head_dim, dtype=torch.bfloat16)
    q, k, v = (
        x.view(-1, x.shape[1] // head_dim, head_dim)
        for x in qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=1)
    )
    # int64 offsets, as the engine passes them (TMA takes 32-bit coordinates).
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int64, device=DEVICE)
    out, lse = tk.prefill_attention(q, k, v, cu, scale=0.2, max_seqlen=max(lens))
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu, scale=0.2)
    _close(out, ref_out, torch.bfloat16)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the next prompt's
def test_prefill_attention_keeps_a_prompt_clear_of_the_next_ones_values(key_loads: str) -> None:
    """Key tiles that run past a prompt's end read the next prompt's rows under TMA: an Inf or
    NaN among its values must not reach this prompt's output."""
    torch.manual_seed(5)
    q, k, v, cu = _packed([37, 20], 4, 2, 32, torch.float32)
    v[37:40] = float("inf")
    v[40] = float("nan")
    out, _ = tk.prefill_attention(q, k, v, cu, scale=0.3)
    _close(out[:37], ref.prefill_attention(q[:37], k[:37], v[:37], cu[:2], 0.3)[0], torch.float32)


def test_prefill_attention_falls_back_to_pointers_where_tma_cannot_address(
    descriptors: _CountedDescriptors,
) -> None:
    """Rows 4 * 33 = 132 bytes apart are not 16-byte aligned: no descriptor, the same result."""
    torch.manual_seed(6)
    q, k, v, cu = _packed([30, 9], 2, 1, 32, torch.float32)
    k_padded, v_padded = (torch.zeros(x.shape[0], 1, 33, device=DEVICE) for x in (k, v))
    k_padded[..., :32], v_padded[..., :32] = k, v
    out, lse = tk.prefill_attention(q, k_padded[..., :32], v_padded[..., :32], cu, scale=0.3)
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu, scale=0.3)
    assert descriptors.made == 0
    _close(out, ref_out, torch.float32)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_prefill_attention_head_dims(head_dim: int, key_loads: str) -> None:
    torch.manual_seed(head_dim)
    q, k, v, cu = _packed([19, 40], 4, 2, head_dim, torch.float32)
    out, lse = tk.prefill_attention(q, k, v, cu, scale=head_dim**-0.5, max_seqlen=40)
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu, scale=head_dim**-0.5)
    _close(out, ref_out, torch.float32)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def _chunks(query_lens: list[int], key_lens: list[int], num_q: int, num_kv: int, dtype):
    """Prompt chunks: sequence i has key_lens[i] keys, its queries being the last query_lens[i]."""
    q, _, _, cu_q = _packed(query_lens, num_q, num_kv, 32, dtype)
    _, k, v, cu_k = _packed(key_lens, num_q, num_kv, 32, dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_of_chunks_after_cached_keys(dtype: torch.dtype, key_loads: str) -> None:
    """Chunks with earlier keys: offsets inside a key tile, past several tiles, none at all."""
    torch.manual_seed(3)
    query_lens, key_lens = [37, 5, 40, 1, 9], [50, 5, 113, 70, 9]
    q, k, v, cu_q, cu_k = _chunks(query_lens, key_lens, 4, 2, dtype)
    out, lse = tk.prefill_attention(q, k, v, cu_q, 0.3, max(query_lens), cu_seqlens_k=cu_k)
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu_q, 0.3, cu_seqlens_k=cu_k)
    _close(out, ref_out, dtype)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 16, 45])
def test_prefill_attention_in_a_sliding_window(window: int, key_loads: str) -> None:
    """Gemma 3's local layers: each query sees its last `window` keys, in whole prompts and in
    chunks after cached keys (the window reaching back into them, or not)."""
    torch.manual_seed(window)
    query_lens, key_lens = [37, 5, 40, 1, 9], [50, 5, 113, 70, 9]
    q, k, v, cu_q, cu_k = _chunks(query_lens, key_lens, 4, 2, torch.float32)
    out, lse = tk.prefill_attention(
        q, k, v, cu_q, 0.3, max(query_lens), cu_seqlens_k=cu_k, sliding_window=window
    )
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu_q, 0.3, cu_k, sliding_window=window)
    _close(out, ref_out, torch.float32)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    # The CPU path's fused SDPA masks alike; a window past the prompt is plain causal.
    sdpa = ref.causal_attention(q, k, v, cu_q, 0.3, cu_k, sliding_window=window)
    _close(sdpa, ref_out, torch.float32)
    whole_q, whole_k, whole_v, cu = _packed([37, 70], 4, 2, 32, torch.float32)
    out = tk.prefill_attention(whole_q, whole_k, whole_v, cu, 0.3, sliding_window=window)[0]
    _close(
        out,
        ref.prefill_attention(whole_q, whole_k, whole_v, cu, 0.3, sliding_window=window)[0],
        torch.float32,
    )
    unbounded = ref.prefill_attention(whole_q, whole_k, whole_v, cu, 0.3)[0]
    assert torch.equal(
        ref.prefill_attention(whole_q, whole_k, whole_v, cu, 0.3, sliding_window=70)[0], unbounded
    )
    if window < 37:
        assert not torch.allclose(out, unbounded)


def test_head_dim_must_be_power_of_two() -> None:
    q, k, v, cu = _packed([4], 2, 2, 48, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        tk.prefill_attention(q, k, v, cu, scale=1.0)


# --- window scores ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa_reduce", ["mean", "max"])
@pytest.mark.parametrize("num_q,num_kv", [(2, 2), (4, 2), (8, 2)])
def test_window_scores_match_reference(
    num_q: int, num_kv: int, gqa_reduce: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(num_q)
    n, window = 77, 20  # window not a multiple of the query tile; n - w not of the key tile
    q, k, v, cu = _packed([n], num_q, num_kv, 32, dtype)
    _, lse = ref.prefill_attention(q, k, v, cu, scale=0.25)
    q_win, lse_win = q[n - window :], lse[:, n - window :]
    scores = tk.window_scores(q_win, k, lse_win, 0.25, gqa_reduce=gqa_reduce)
    expected = ref.window_scores(q_win, k, lse_win, 0.25, gqa_reduce=gqa_reduce)
    assert scores.shape == (num_kv, n - window) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, atol=1e-6, rtol=1e-4)


def test_window_scores_from_kernel_lse() -> None:
    """The pipeline as the engine runs it: prefill's LSE feeds scoring directly."""
    torch.manual_seed(1)
    n, window = 45, 8
    q, k, v, cu = _packed([n], 4, 2, 64, torch.float32)
    _, lse = tk.prefill_attention(q, k, v, cu, scale=0.125)
    scores = tk.window_scores(q[n - window :], k, lse[:, n - window :], 0.125)
    expected = ref.window_scores(
        q[n - window :], k, ref.window_lse(q[n - window :], k, 0.125), 0.125
    )
    torch.testing.assert_close(scores, expected, atol=1e-6, rtol=1e-4)


# --- paged decode attention ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("num_q,num_kv", [(2, 2), (4, 2), (8, 2)])
# 8: key tiles span several pages (gathered per token); 16 and 32: pages of one and two whole
# tiles (one page number per tile) on the CPU, where a tile has 16 keys.
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_decode_matches_reference(
    num_q: int, num_kv: int, num_splits: int | None, dtype: torch.dtype, block_size: int
) -> None:
    torch.manual_seed(num_q + (num_splits or 0))
    # Context lengths not multiples of the page size; the short one leaves later splits empty.
    k_cache, v_cache, table, lens = _paged(
        [37, 3, 50], num_kv, 32, block_size=block_size, dtype=dtype
    )
    q = _randn(3, num_q, 32, dtype=dtype)
    out = tk.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.2, num_splits=num_splits)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.2)
    assert out.dtype == dtype
    _close(out, expected, dtype)


def test_paged_decode_head_dim_128_and_given_max_len() -> None:
    torch.manual_seed(2)
    k_cache, v_cache, table, lens = _paged([21, 16], 1, 128, block_size=16, dtype=torch.float32)
    q = _randn(2, 4, 128, dtype=torch.float32)
    out = tk.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1, max_context_len=32)
    _close(out, ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.1), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_reads_past_a_stale_bound(num_splits: int) -> None:
    """A CUDA graph captured at a shorter max_context_len still sees the grown contexts, split
    or not."""
    torch.manual_seed(6)
    k_cache, v_cache, table, lens = _paged([45, 30], 2, 32, block_size=8, dtype=torch.float32)
    q = _randn(2, 4, 32, dtype=torch.float32)
    out = tk.paged_decode_attention(
        q, k_cache, v_cache, table, lens, 0.2, max_context_len=20, num_splits=num_splits
    )
    _close(out, ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.2), torch.float32)


# (prefill kernel, decode kernel, decode's extra arguments) of each kernel set with an `out`
OUT_KERNELS = {
    "triton": (tk.prefill_attention, tk.paged_decode_attention, {"num_splits": 1}),
    "triton-3-splits": (tk.prefill_attention, tk.paged_decode_attention, {"num_splits": 3}),
    "reference": (ref.prefill_attention, ref.paged_decode_attention, {}),
    "sdpa": (ref.causal_attention, ref.paged_decode_attention, {}),
}


@pytest.mark.parametrize("decode_first", [False, True])
@pytest.mark.parametrize("kernels", list(OUT_KERNELS))
def test_prompt_and_decode_rows_write_into_one_output(kernels: str, decode_first: bool) -> None:
    """A step that prefills and decodes writes both attentions into the rows of one tensor
    (`out`), each kernel touching only its own rows, whichever runs first."""
    prefill, decode, decode_args = OUT_KERNELS[kernels]
    torch.manual_seed(7)
    q, k, v, cu = _packed([9, 14], 4, 2, 32, torch.float32)
    k_cache, v_cache, table, lens = _paged([37, 3], 2, 32, block_size=8, dtype=torch.float32)
    q_decode = _randn(2, 4, 32, dtype=torch.float32)
    n = q.shape[0]
    out = torch.full((n + 2, 4, 32), float("nan"), device=DEVICE)
    writes = [
        lambda: prefill(q, k, v, cu, 0.3, out=out[:n]),
        lambda: decode(q_decode, k_cache, v_cache, table, lens, 0.2, out=out[n:], **decode_args),
    ]
    for write in reversed(writes) if decode_first else writes:
        write()
    _close(out[:n], ref.prefill_attention(q, k, v, cu, 0.3)[0], torch.float32)
    expected = ref.paged_decode_attention(q_decode, k_cache, v_cache, table, lens, 0.2)
    _close(out[n:], expected, torch.float32)


def test_split_count_heuristic() -> None:
    device = torch.device(DEVICE)
    sms = tk._num_sms(device)
    # Enough (sequence, KV head) programs to cover every SM: no split.
    assert tk.decode_num_splits(sms, 1, 4500, device) == 1
    # One long sequence is split, but never below one key tile per split.
    splits = tk.decode_num_splits(1, 1, 4500, device)
    assert 1 < splits <= 4500 // tk._MIN_TOKENS_PER_SPLIT
    assert tk.decode_num_splits(1, 1, tk._MIN_TOKENS_PER_SPLIT - 1, device) == 1


def test_fp8_split_count_fills_the_waves_of_programs(monkeypatch) -> None:
    """An FP8 cache's rule on the H200's 132 SMs (4 programs an SM at once): each split count
    takes the fewest waves per unit of work among the counts allowed; from 3 x SMs programs,
    or a context shorter than two splits' keys, unsplit."""
    monkeypatch.setattr(tk, "_num_sms", lambda device: 132)
    cpu, fp8, wave = torch.device("cpu"), FP8_DTYPE, 4 * 132

    def cost(programs: int, splits: int) -> float:
        return -(-programs * splits // wave) / splits

    for batch in (1, 8, 16, 20, 32, 40, 46, 49):
        splits = tk.decode_num_splits(batch, 8, 4608, cpu, fp8)
        most = 4 if batch * 8 >= 132 else 4608 // tk._FP8_MIN_TOKENS_PER_SPLIT
        assert 1 <= splits <= most
        assert all(cost(batch * 8, splits) <= cost(batch * 8, s) for s in range(1, most + 1))
    assert tk.decode_num_splits(20, 8, 4608, cpu, fp8) == 3  # 480 programs: one wave, not 640
    assert tk.decode_num_splits(50, 8, 4608, cpu, fp8) == 1
    assert tk.decode_num_splits(20, 8, 2 * tk._FP8_MIN_TOKENS_PER_SPLIT - 1, cpu, fp8) == 1
    assert tk.decode_num_splits(1, 8, 10**6, cpu, fp8) == tk._MAX_SPLITS  # the merge's bound


# --- RoPE and the KV store, alone and fused with decode attention ----------------------------


def _qkv_views(qkv: torch.Tensor, num_q: int, num_kv: int, head_dim: int):
    """q, k, v as views into a fused qkv projection's output [T, (Hq + 2 Hkv) * D]."""
    sizes = [num_q * head_dim, num_kv * head_dim, num_kv * head_dim]
    return [t.view(qkv.shape[0], -1, head_dim) for t in qkv.split(sizes, dim=-1)]


def _rope_tables(head_dim: int, positions: int = 64):
    freqs = torch.outer(torch.arange(float(positions)), torch.rand(head_dim // 2)).to(DEVICE)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q", "num_kv", "head_dim"), [(4, 2, 16), (9, 3, 64), (32, 8, 128)])
def test_rotate_and_store_kv_on_qkv_views(dtype, num_q, num_kv, head_dim):
    """q and k rotated in place inside the fused qkv projection (v untouched), and the rotated k
    and v written to the paged caches at their slots; -1 writes nothing."""
    tokens, block_size, num_blocks = 7, 4, 5
    qkv = _randn(tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 3, 1, 17, 9, 2, 30], device=DEVICE)
    slots = torch.tensor([5, -1, 0, 19, 12, -1, 7], device=DEVICE)
    cos, sin = _rope_tables(head_dim)

    def run(rotate_and_store_kv):
        x = qkv.clone()
        q, k, v = _qkv_views(x, num_q, num_kv, head_dim)
        # The K cache plain, the V cache a strided view (K and V side by side per head, as the
        # vLLM plugin lays them out): strides of one mistaken for the other's show.
        k_cache = torch.full((num_blocks, block_size, num_kv, head_dim), 7.0, device=DEVICE)
        kv = torch.full((num_blocks, block_size, num_kv, 2 * head_dim), 7.0, device=DEVICE)
        caches = [k_cache.to(dtype), kv.to(dtype)[..., head_dim:]]
        rotate_and_store_kv(q, k, v, positions, cos, sin, *caches, slots)
        return x, caches

    expected, expected_caches = run(ref.rotate_and_store_kv)
    actual, actual_caches = run(tk.rotate_and_store_kv)
    _close(actual, expected, dtype)
    q_cols, v_cols = num_q * head_dim, num_kv * head_dim
    assert not torch.equal(actual[:, :q_cols], qkv[:, :q_cols])  # q was rotated
    assert torch.equal(actual[:, -v_cols:], qkv[:, -v_cols:])  # v untouched
    for cache, want in zip(actual_caches, expected_caches, strict=True):
        _close(cache, want, dtype)
    assert (actual_caches[1].flatten(0, 1)[[1, 2, 3, 4]] == 7.0).all()  # slots never named


def _rotate_store_and_decode_case(
    context_lens: list[int],
    num_q: int,
    num_kv: int,
    head_dim: int,
    block_size: int,
    dtype,
    dropped: int = 0,
):
    """A decode step's inputs: paged caches holding each sequence's earlier tokens, its new
    token's q, k, v as views of one qkv tensor, at position context_len - 1 + dropped (a
    compressed layer's cache holds fewer tokens than the sequence has), stored in the cache's
    last row (the second sequence's at -1: not stored, its stale cache row read)."""
    k_cache, v_cache, table, lens = _paged(context_lens, num_kv, head_dim, block_size, dtype)
    rows = torch.tensor(context_lens, device=DEVICE) - 1
    pages = table.long().gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    slots = pages * block_size + rows % block_size
    if len(context_lens) > 1:
        slots[1] = -1
    positions = rows + dropped
    qkv = _randn(len(context_lens), (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    cos, sin = _rope_tables(head_dim, max(context_lens) + dropped)
    return qkv, positions, cos, sin, k_cache, v_cache, slots, table, lens


def _check_rotate_store_and_decode(case, num_q, num_kv, head_dim, dtype, **kwargs) -> None:
    """The Triton op against the reference: output, q and k rotated in place, both caches."""
    qkv, positions, cos, sin, k_cache, v_cache, slots, table, lens = case
    results = []
    for op, extra in ((ref.rotate_store_and_decode, {}), (tk.rotate_store_and_decode, kwargs)):
        x, caches = qkv.clone(), (k_cache.clone(), v_cache.clone())
        q, k, v = _qkv_views(x, num_q, num_kv, head_dim)
        out = op(q, k, v, positions, cos, sin, *caches, slots, table, lens, 0.3, **extra)
        results.append((out, x, caches))
    (want, want_qkv, want_caches), (out, got_qkv, got_caches) = results
    _close(out, want, dtype)
    _close(got_qkv, want_qkv, dtype)
    for cache, expected in zip(got_caches, want_caches, strict=True):
        _close(cache, expected, dtype)
    assert not torch.equal(got_caches[0], k_cache)  # the new keys were stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 1: rotated and stored in the decode kernel itself; 3: stored in a launch of its own first.
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q,num_kv", [(2, 2), (8, 2)])
# 8: key tiles gathered per token; 16: one page number per tile (CPU tiles hold 16 keys).
@pytest.mark.parametrize("block_size", [8, 16])
# 0: a whole layer (position = cache length - 1); 300: a compressed one, 300 tokens dropped.
@pytest.mark.parametrize("dropped", [0, 300])
def test_rotate_store_and_decode_matches_reference(
    dtype: torch.dtype, num_splits: int | None, num_q: int, num_kv: int, block_size: int,
    dropped: int,
) -> None:  # fmt: skip
    """Attention reads each sequence's new key and value, rotated and stored in the same call,
    whether the context ends inside a tile, on its first key, or after one key."""
    torch.manual_seed(num_q + block_size + num_splits)
    case = _rotate_store_and_decode_case(
        [37, 3, 17, 1], num_q, num_kv, 32, block_size, dtype, dropped
    )
    _check_rotate_store_and_decode(case, num_q, num_kv, 32, dtype, num_splits=num_splits)


# --- moving tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference_and_skips_negative_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    num_tokens, num_kv, head_dim, block_size, num_blocks = 21, 2, 32, 4, 9
    k, v = (_randn(num_tokens, num_kv, head_dim, dtype=dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    slots[[2, 7]] = -1
    caches = [_randn(num_blocks, block_size, num_kv, head_dim, dtype=dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    kept = slots >= 0
    ref.store_kv(k[kept], v[kept], *expected, slots[kept])
    tk.store_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_store_kv_casts_to_cache_dtype() -> None:
    k, v = (_randn(5, 2, 16, dtype=torch.float32) for _ in range(2))
    caches = [torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    slots = torch.tensor([7, 0, 3, 4, 1], device=DEVICE)
    tk.store_kv(k, v, *caches, slots)
    assert torch.equal(caches[0].view(8, 2, 16)[slots], k.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_tokens_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    x = _randn(50, 4, 64, dtype=dtype)
    indices = torch.stack([torch.randperm(50)[:19].sort().values for _ in range(4)]).to(DEVICE)
    assert torch.equal(tk.gather_tokens(x, indices), ref.gather_tokens(x, indices))


@pytest.mark.parametrize("num_kv", [1, 2, 4])
def test_store_selected_kv_is_gather_then_store(num_kv: int) -> None:
    torch.manual_seed(5 + num_kv)
    n, budget, head_dim, block_size, num_blocks = 60, 23, 32, 8, 7
    k, v = (_randn(n, num_kv, head_dim, dtype=torch.bfloat16) for _ in range(2))
    scores = torch.rand(num_kv, n - 8, device=DEVICE)
    indices = ref.select_top_tokens(scores, n, budget, window=8, sinks=2)
    # Kept positions go to a shuffled run of pages, like a freshly allocated block table.
    pages = torch.randperm(num_blocks)[: math.ceil(budget / block_size)]
    slots = (pages[:, None] * block_size + torch.arange(block_size)).flatten()[:budget].to(DEVICE)
    caches = [
        torch.zeros(num_blocks, block_size, num_kv, head_dim, dtype=torch.bfloat16, device=DEVICE)
        for _ in range(2)
    ]
    expected = [c.clone() for c in caches]
    ref.store_kv(ref.gather_tokens(k, indices), ref.gather_tokens(v, indices), *expected, slots)
    tk.store_selected_kv(k, v, indices, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("pooling", ["avg", "max", "none"])
@pytest.mark.parametrize(
    "lengths",
    [
        [150],
        [41, 97, 64],
        # Prompts of several 1,024-key tiles, as compiled on a GPU (the interpreter's tiles hold
        # 16 keys, so the short prompts cross tiles there already).
        pytest.param([4000, 2500, 1100], marks=needs_cuda),
    ],
)
@pytest.mark.parametrize("tied", [False, True])
def test_select_kept_rows_matches_reference(pooling: str, lengths: list[int], tied: bool) -> None:
    """Pooling, top-k and the kept rows of several prompts in one launch, each keeping its own
    number of tokens, exactly the torch selection's; with scores of a few distinct values, ties
    go to the earlier token as there."""
    torch.manual_seed(len(lengths) + 3 * tied)
    window, sinks, num_kv = 8, 3, 2
    kept_counts = [max(window + sinks + 1, n // 4) for n in lengths]
    scores = [
        torch.randint(0, 4, (num_kv, n - window), device=DEVICE).float()
        if tied
        else torch.rand(num_kv, n - window, device=DEVICE)
        for n in lengths
    ]
    scored_lens = torch.tensor([n - window for n in lengths], device=DEVICE)
    starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], device=DEVICE)
    offsets = torch.tensor([0, *itertools.accumulate(kept_counts)], device=DEVICE)
    args = (scores, scored_lens, starts, offsets, kept_counts, window, sinks, pooling, 7)
    kept = tk.select_kept_rows(*args)
    assert kept.shape == (num_kv, sum(kept_counts))
    assert torch.equal(kept, ref.select_kept_rows(*args))


@pytest.mark.parametrize("num_prompts", [3, 6])
def test_snapkv_selection_of_a_prompt_batch_matches_reference(num_prompts: int) -> None:
    """SnapKV over the engine's PromptBatch, every kernel of the GPU set (the prefill kernel's
    LSE, window scores, selection) against the reference set: the same kept rows for every
    prompt. With two prompts a strided `starts` reads right by chance (prompt 1 starts where
    prompt 0 ends); from the third on it would not."""
    torch.manual_seed(num_prompts)
    lengths = [70 + 13 * j for j in range(num_prompts)]
    q, k, v, cu = _packed(lengths, 4, 2, 32, torch.float32)
    bounds = list(itertools.pairwise([0, *itertools.accumulate(lengths)]))
    prompts = PromptBatch.from_bounds(bounds, [30 + j for j in range(num_prompts)], k.device)
    sparsity = SparsityConfig(policy="snapkv", window=8, sinks=2)
    triton_ops = dataclasses.replace(
        REFERENCE_OPS,
        prefill_attention=tk.prefill_attention,
        window_scores=tk.window_scores,
        select_kept_rows=tk.select_kept_rows,
    )
    _, lse = triton_ops.prefill_attention(q, k, v, cu, 32**-0.5, max(lengths))
    kept = selection_policy(sparsity, triton_ops).select(q, k, lse, prompts, 32**-0.5)
    expected = selection_policy(sparsity, REFERENCE_OPS).select(q, k, None, prompts, 32**-0.5)
    assert torch.equal(kept, expected)


def test_select_kept_rows_ties_signed_zeros_as_equals() -> None:
    """-0.0 and 0.0 are one value to a sort; the earlier of them is kept."""
    scores = [torch.tensor([[1.0, -0.0, 0.0, 0.0, 2.0, 1.0, -1.0, 0.5, 0.5]], device=DEVICE)]
    one = (torch.tensor([9], device=DEVICE), torch.tensor([0], device=DEVICE))
    args = (scores, *one, torch.tensor([0, 8], device=DEVICE), [8], 2, 0)
    kept = tk.select_kept_rows(*args, "none", 1)
    assert torch.equal(kept, ref.select_kept_rows(*args, "none", 1))
    assert kept.tolist() == [[0, 1, 4, 5, 7, 8, 9, 10]]


def test_chunk_context_packs_cached_and_new_rows() -> None:
    """Keys packed apart from the queries, as for prompts continued from earlier chunks: each
    prompt's cached rows, read from the paged cache (the same slots for every head), then its new
    rows; both kernel sets."""
    torch.manual_seed(11)
    num_kv, head_dim, block_size, num_blocks = 2, 32, 4, 6
    caches = [_randn(num_blocks, block_size, num_kv, head_dim, dtype=torch.bfloat16) for _ in "kv"]
    new = [_randn(7, num_kv, head_dim, dtype=torch.bfloat16) for _ in "kv"]
    # Prompt 0: 5 cached tokens, then 3 new; prompt 1: 2 cached, then 4 new.
    cached_slots = torch.tensor([9, 10, 11, 12, 13, 3, 0], device=DEVICE)
    context = ChunkContext(
        cu_seqlens_k=torch.tensor([0, 8, 14], device=DEVICE),
        num_keys=14,
        new_rows=torch.tensor([5, 6, 7, 10, 11, 12, 13], device=DEVICE),
        cached_rows=torch.tensor([0, 1, 2, 3, 4, 8, 9], device=DEVICE),
    )
    expected = []
    for rows, cache in zip(new, caches, strict=True):
        packed = rows.new_empty(14, num_kv, head_dim)
        packed[context.new_rows] = rows
        packed[context.cached_rows] = cache.flatten(0, 1)[cached_slots]
        expected.append(packed)
    triton_ops = SimpleNamespace(store_kv=tk.store_kv, store_selected_kv=tk.store_selected_kv)
    for ops in (REFERENCE_OPS, triton_ops):
        packed_k, packed_v = context.pack(ops, *new, *caches, cached_slots, UNIT_SCALES)
        assert torch.equal(packed_k, expected[0]) and torch.equal(packed_v, expected[1])


# --- FP8 caches: e4m3 pages with a K and a V scale per layer -----------------------------------

# Scales unlike 1 and unlike each other, so a K scale applied to V (or one forgotten) shows.
SCALES = KVScales(k=0.37, v=2.5)


def _fp8_paged(context_lens: list[int], num_kv: int, head_dim: int, block_size: int):
    """`_paged`'s caches as FP8 pages."""
    k_cache, v_cache, table, lens = _paged(
        context_lens, num_kv, head_dim, block_size, torch.float32
    )
    return k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE), table, lens


def test_fp8_store_saturates_and_rounds_like_torch() -> None:
    """k / k_scale in e4m3, rounded to nearest even (the interpreter fixed to match the GPU),
    saturated at +-448 instead of NaN; the reference is torch's own cast."""
    torch.manual_seed(21)
    k, v = _randn(30, 2, 32, dtype=torch.bfloat16), _randn(30, 2, 32, dtype=torch.bfloat16)
    k[3, 1, 5], v[4, 0, 0] = 1e4, -1e5  # past the range once scaled
    slots = torch.randperm(40)[:30].to(DEVICE)
    caches = [torch.zeros(10, 4, 2, 32, dtype=FP8_DTYPE, device=DEVICE) for _ in "kv"]
    expected = [c.clone() for c in caches]
    ref.store_kv(k, v, *expected, slots, SCALES)
    tk.store_kv(k, v, *caches, slots, SCALES)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    k_stored = caches[0].view(40, 2, 32)[slots].float()
    assert k_stored[3, 1, 5] == FP8_MAX and caches[1].view(40, 2, 32)[slots][4, 0, 0] == -FP8_MAX
    finite = k_stored.isfinite().all() and caches[1].float().isfinite().all()
    assert finite
    back = k_stored * SCALES.k
    k[3, 1, 5] = back[3, 1, 5]
    assert ((back - k.float()).norm() / k.float().norm()).item() < 0.04  # 3 mantissa bits


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
def test_fp8_paged_decode_matches_reference(num_splits: int, block_size: int) -> None:
    """The kernel widens e4m3 keys and values and applies their scales; the reference computes
    over the dequantized cache in float32."""
    torch.manual_seed(22 + num_splits)
    k_cache, v_cache, table, lens = _fp8_paged([37, 3, 50], 2, 32, block_size)
    q = _randn(3, 8, 32, dtype=torch.bfloat16)
    out = tk.paged_decode_attention(
        q, k_cache, v_cache, table, lens, 0.2, kv_scales=SCALES, num_splits=num_splits
    )
    expected = ref.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.2, kv_scales=SCALES)
    dequantized = ref.paged_decode_attention(
        q.float(), k_cache.float() * SCALES.k, v_cache.float() * SCALES.v, table, lens, 0.2
    )
    torch.testing.assert_close(expected.float(), dequantized, atol=2e-2, rtol=1e-2)
    _close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_rotate_store_and_decode_matches_reference(num_splits: int) -> None:
    """The decode step's own keys quantized into the FP8 cache and read back in one call."""
    torch.manual_seed(23)
    case = list(_rotate_store_and_decode_case([37, 3, 17, 1], 8, 2, 32, 16, torch.bfloat16))
    case[4], case[5] = case[4].to(FP8_DTYPE), case[5].to(FP8_DTYPE)  # the caches
    qkv, positions, cos, sin, k_cache, v_cache, slots, table, lens = case
    results = []
    for op, extra in ((ref.rotate_store_and_decode, {}), (tk.rotate_store_and_decode, {})):
        x, caches = qkv.clone(), (k_cache.clone(), v_cache.clone())
        q, k, v = _qkv_views(x, 8, 2, 32)
        if op is tk.rotate_store_and_decode:
            extra = {"num_splits": num_splits}
        out = op(
            q, k, v, positions, cos, sin, *caches, slots, table, lens, 0.3, kv_scales=SCALES,
            **extra,
        )  # fmt: skip
        results.append((out, caches))
    (want, want_caches), (out, got_caches) = results
    _close(out, want, torch.bfloat16)
    for got, expected in zip(got_caches, want_caches, strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(got_caches[0].view(torch.uint8), k_cache.view(torch.uint8))


def test_fp8_compaction_and_chunk_packing_round_trip() -> None:
    """Kept tokens quantized into an FP8 cache (compress-on-write), then packed back out of it
    in the step's dtype for a later chunk: both kernel sets, bit for bit, and the packed rows
    are the kept tokens within e4m3's rounding."""
    torch.manual_seed(24)
    n, budget, num_kv, head_dim, block_size, num_blocks = 40, 13, 2, 32, 4, 6
    k, v = (_randn(n, num_kv, head_dim, dtype=torch.bfloat16) for _ in "kv")
    indices = ref.select_top_tokens(torch.rand(num_kv, n - 4, device=DEVICE), n, budget, 4, 1)
    slots = torch.randperm(num_blocks * block_size)[:budget].to(DEVICE)
    context = ChunkContext(
        cu_seqlens_k=torch.tensor([0, budget + 2], device=DEVICE),
        num_keys=budget + 2,
        new_rows=torch.tensor([budget, budget + 1], device=DEVICE),
        cached_rows=torch.arange(budget, device=DEVICE),
    )
    new = [_randn(2, num_kv, head_dim, dtype=torch.bfloat16) for _ in "kv"]
    triton_ops = SimpleNamespace(store_kv=tk.store_kv, store_selected_kv=tk.store_selected_kv)
    results = []
    for ops in (REFERENCE_OPS, triton_ops):
        caches = [
            torch.zeros(num_blocks, block_size, num_kv, head_dim, dtype=FP8_DTYPE, device=DEVICE)
            for _ in "kv"
        ]
        ops.store_selected_kv(k, v, indices, *caches, slots, SCALES)
        # Every head's kept tokens now sit at the same slots: the cached chunk of one prompt.
        packed = context.pack(ops, *new, *caches, slots, SCALES)
        results.append((caches, packed))
    (want_caches, want_packed), (got_caches, got_packed) = results
    for got, want in zip([*got_caches, *got_packed], [*want_caches, *want_packed], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    kept_k = ref.gather_tokens(k, indices)
    assert got_packed[0].dtype == torch.bfloat16
    torch.testing.assert_close(got_packed[0][:budget].float(), kept_k.float(), rtol=0.07, atol=0.02)
    assert torch.equal(got_packed[1][budget:], new[1])


# --- realistic shapes on a GPU (Llama-3-8B attention: 32 query heads, 8 KV heads, D=128) --------

BF16 = torch.bfloat16


@gpu
@needs_cuda
def test_gpu_prefill_4000_tokens() -> None:
    torch.manual_seed(10)
    q, k, v, cu = _packed([4000, 1500, 37], 32, 8, 128, BF16)
    out, lse = tk.prefill_attention(q, k, v, cu, scale=128**-0.5)
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu, scale=128**-0.5)
    _close(out, ref_out, BF16)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@gpu
@needs_cuda
def test_gpu_prefill_of_a_chunk_after_3000_cached_tokens() -> None:
    torch.manual_seed(12)
    q, k, v, cu_q, cu_k = _chunks([1000, 2048, 1], [4000, 2100, 3001], 32, 8, BF16)
    q, k, v = (x.repeat_interleave(4, dim=-1) for x in (q, k, v))  # head dim 128
    out, lse = tk.prefill_attention(q, k, v, cu_q, 128**-0.5, 2048, cu_seqlens_k=cu_k)
    ref_out, ref_lse = ref.prefill_attention(q, k, v, cu_q, 128**-0.5, cu_seqlens_k=cu_k)
    _close(out, ref_out, BF16)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@gpu
@needs_cuda
@pytest.mark.parametrize("gqa_reduce", ["mean", "max"])
def test_gpu_window_scores_4000_tokens(gqa_reduce: str) -> None:
    torch.manual_seed(11)
    n, window = 4000, 32
    q, k, v, cu = _packed([n], 32, 8, 128, BF16)
    _, lse = tk.prefill_attention(q, k, v, cu, scale=128**-0.5)
    args = (q[n - window :], k, lse[:, n - window :], 128**-0.5)
    scores = tk.window_scores(*args, gqa_reduce=gqa_reduce)
    torch.testing.assert_close(
        scores, ref.window_scores(*args, gqa_reduce=gqa_reduce), atol=1e-5, rtol=1e-3
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("batch,context", [(64, 4500), (2, 4500), (64, 512), (20, 800)])
# 16: gathered per token; 128 and 256: one page number per 128-key tile.
@pytest.mark.parametrize("block_size", [16, 128, 256])
def test_gpu_paged_decode(batch: int, context: int, block_size: int) -> None:
    torch.manual_seed(12)
    # Ragged contexts around the target length.
    lens = (context - torch.randint(0, 100, (batch,))).tolist()
    k_cache, v_cache, table, lens_t = _paged(lens, 8, 128, block_size=block_size, dtype=BF16)
    q = _randn(batch, 32, 128, dtype=BF16)
    out = tk.paged_decode_attention(q, k_cache, v_cache, table, lens_t, 128**-0.5)
    _close(out, ref.paged_decode_attention(q, k_cache, v_cache, table, lens_t, 128**-0.5), BF16)


@gpu
@needs_cuda
# 20 x 8 programs: the decode kernel stores the new keys itself; 2 x 8: split, stored first.
# Contexts of 1-2 tokens: attention there is mostly the new key, a stale one would show.
@pytest.mark.parametrize("batch,context", [(20, 2), (20, 800), (20, 4300), (2, 4300)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_rotate_store_and_decode(batch: int, context: int, block_size: int) -> None:
    torch.manual_seed(13)
    lens = (context - torch.randint(0, min(100, context), (batch,))).tolist()
    case = _rotate_store_and_decode_case(lens, 32, 8, 128, block_size, BF16)
    _check_rotate_store_and_decode(case, 32, 8, 128, BF16)


@gpu
@needs_cuda
def test_gpu_store_and_compact_4000_tokens() -> None:
    torch.manual_seed(13)
    n, budget, block_size = 4000, 512, 16
    k, v = (_randn(n, 8, 128, dtype=BF16) for _ in range(2))
    caches = [torch.zeros(400, block_size, 8, 128, dtype=BF16, device=DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    slots = torch.randperm(400 * block_size, device=DEVICE)[:n]
    tk.store_kv(k, v, *caches, slots)
    ref.store_kv(k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])

    indices = ref.select_top_tokens(torch.rand(8, n - 32, device=DEVICE), n, budget, 32, 4)
    kept_slots = torch.arange(budget, device=DEVICE) + 1000
    tk.store_selected_kv(k, v, indices, *caches, kept_slots)
    ref.store_kv(
        ref.gather_tokens(k, indices), ref.gather_tokens(v, indices), *expected, kept_slots
    )
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@gpu
@needs_cuda
@pytest.mark.parametrize("batch,context", [(64, 4500), (2, 4500), (20, 800)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_fp8_paged_decode(batch: int, context: int, block_size: int) -> None:
    torch.manual_seed(14)
    lens = (context - torch.randint(0, 100, (batch,))).tolist()
    k_cache, v_cache, table, lens_t = _fp8_paged(lens, 8, 128, block_size)
    q = _randn(batch, 32, 128, dtype=BF16)
    args = (q, k_cache, v_cache, table, lens_t, 128**-0.5)
    out = tk.paged_decode_attention(*args, kv_scales=SCALES)
    _close(out, ref.paged_decode_attention(*args, kv_scales=SCALES), BF16)


@gpu
@needs_cuda
def test_gpu_fp8_store_and_compact_4000_tokens() -> None:
    torch.manual_seed(15)
    n, budget, block_size = 4000, 512, 128
    k, v = (_randn(n, 8, 128, dtype=BF16) * 4 for _ in range(2))
    caches = [torch.zeros(40, block_size, 8, 128, dtype=FP8_DTYPE, device=DEVICE) for _ in "kv"]
    expected = [c.clone() for c in caches]
    slots = torch.randperm(40 * block_size, device=DEVICE)[:n]
    tk.store_kv(k, v, *caches, slots, SCALES)
    ref.store_kv(k, v, *expected, slots, SCALES)
    indices = ref.select_top_tokens(torch.rand(8, n - 32, device=DEVICE), n, budget, 32, 4)
    kept_slots = torch.arange(budget, device=DEVICE) + 1000
    tk.store_selected_kv(k, v, indices, *caches, kept_slots, SCALES)
    ref.store_selected_kv(k, v, indices, *expected, kept_slots, SCALES)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@gpu
@needs_cuda
@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_gpu_select_kept_rows_of_4000_and_2500_tokens(pooling: str) -> None:
    """Llama-3-8B's 8 KV heads, budget 512, window 32: several tiles per prompt."""
    torch.manual_seed(17)
    lengths, window = [4000, 2500], 32
    scores = [torch.rand(8, n - window, device=DEVICE) for n in lengths]
    args = (
        scores,
        torch.tensor([n - window for n in lengths], device=DEVICE),
        torch.tensor([0, lengths[0]], device=DEVICE),
        torch.tensor([0, 512, 1024], device=DEVICE),
        [512, 512],
        window,
        4,
        pooling,
        7,
    )
    assert torch.equal(tk.select_kept_rows(*args), ref.select_kept_rows(*args))


def test_reference_kernels_swap_in_by_name(monkeypatch) -> None:
    """$KVSPARSE_REFERENCE_KERNELS takes the named kernels of a GPU's set from the reference
    (to find which kernel a wrong GPU result comes from); a name that is no kernel is refused."""
    from sparse_core import kernels

    triton_ops = kernels._triton_ops()
    ops = kernels.with_reference_kernels(triton_ops, "store_selected_kv, paged_decode_attention")
    assert ops.store_selected_kv is ref.store_selected_kv
    assert ops.paged_decode_attention is ref.paged_decode_attention
    assert ops.prefill_attention is tk.prefill_attention
    assert kernels.with_reference_kernels(triton_ops, "") is triton_ops
    assert kernels.with_reference_kernels(triton_ops, "all") is kernels.REFERENCE_OPS
    with pytest.raises(ValueError, match=r"unknown kernel\(s\) \['store_everything'\]"):
        kernels.with_reference_kernels(triton_ops, "store_kv,store_everything")
    monkeypatch.setenv(kernels.REFERENCE_KERNELS_ENV, "rms_norm")
    assert kernels.get_ops(torch.device("cuda")).rms_norm is ref.rms_norm

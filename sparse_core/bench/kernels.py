"""GPU check and microbenchmark of the Triton kernels: `python -m sparse_core.bench.kernels`.

1. Checks every kernel against `reference.py` at realistic shapes (max abs error, PASS/FAIL).
2. Times, at the Llama-3-8B attention shape (32 query heads, 8 KV heads, D=128, bf16):
   - prefill attention with LSE vs torch SDPA (flash backend) at 4000 tokens;
   - window scoring in one pass from LSE vs materialising the window's softmax rows, n=4000, w=32;
   - compaction (gather kept tokens + write into pages) of one layer, n=4000, budget 512;
   - paged decode attention at batch 1..128 over 4500-token dense and 512-token compressed
     contexts, with a bf16 and an FP8 (e4m3) cache, as achieved GB/s (K+V bytes read / time)
     and as a fraction of the measured device-copy bandwidth (the roofline), with and without
     split-K; with an FP8 cache also at every split count of a sweep (SPLIT_SWEEP);
   - FP8 linear layers (Llama-3-8B's four projections) at decode batch sizes, by each route of
     `fp8_linear_cuda` (`_scaled_mm` with row-wise scales and fast accumulation, the few-rows
     Triton matmul), as weight bytes read per second and as a fraction of the roofline.
Kernel times are GPU time per call: the calls are captured in a CUDA graph and replayed (as the
engine's decode step is), each on its own copy of the inputs until the copies exceed the L2
cache, so launch overhead and L2 hits do not flatter small kernels. Needs only torch and triton.
`--json PATH` writes every number.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparse_core.config import CUDA_BLOCK_SIZE
from sparse_core.kernels import reference as ref
from sparse_core.kernels import triton_fp8
from sparse_core.kernels import triton_kernels as tk
from sparse_core.kernels.fp8 import FP8_DTYPE, quantize_rows

NUM_Q, NUM_KV, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
BLOCK_SIZE = CUDA_BLOCK_SIZE  # tokens per KV page, as the engine has them on CUDA
DEVICE = "cuda"


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def _packed(
    seq_lens: list[int], num_q: int = NUM_Q, num_kv: int = NUM_KV, head_dim: int = HEAD_DIM
):
    total = sum(seq_lens)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = _randn(total, num_q, head_dim)
    k = _randn(total, num_kv, head_dim)
    v = _randn(total, num_kv, head_dim)
    return q, k, v, cu.to(DEVICE)


def _cache_name(cache_dtype: torch.dtype) -> str:
    return "fp8" if cache_dtype == FP8_DTYPE else "bf16"


def _paged(context_lens: list[int], cache_dtype: torch.dtype = DTYPE):
    """K/V caches of `cache_dtype` holding exactly these contexts in shuffled pages, and the
    table."""
    pages = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(pages)
    k_cache = _randn(num_blocks, BLOCK_SIZE, NUM_KV, HEAD_DIM).to(cache_dtype)
    v_cache = _randn(num_blocks, BLOCK_SIZE, NUM_KV, HEAD_DIM).to(cache_dtype)
    order = torch.randperm(num_blocks)
    table = torch.zeros(len(context_lens), max(pages), dtype=torch.int32)
    start = 0
    for i, count in enumerate(pages):
        table[i, :count] = order[start : start + count]
        start += count
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, table.to(DEVICE), lens


# Rotating over this many bytes of distinct inputs evicts the H200's 60 MB L2 between reuses.
L2_FLUSH_BYTES = 256 * 2**20


def _num_copies(bytes_per_call: int, most: int = 128) -> int:
    """How many distinct input sets make one timing pass stream from HBM rather than L2."""
    return max(1, min(most, math.ceil(L2_FLUSH_BYTES / bytes_per_call)))


def _time_ms(calls: list[Callable[[], Any]]) -> float:
    """GPU time per call, in ms (median).

    The calls (one per distinct input set) are captured in one CUDA graph and replayed, as the
    engine's decode step is: no CPU launch overhead, which would otherwise dominate sub-50 µs
    kernels, and no L2 reuse when the input sets together exceed L2_FLUSH_BYTES.
    """
    for call in calls:
        call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(
        lambda: [call() for call in calls], rep=50, return_mode="median"
    )
    return ms / len(calls)


# --- 1. correctness -----------------------------------------------------------------------------


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def run_checks() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    results: list[dict[str, Any]] = []

    def record(name: str, err: float, tol: float) -> None:
        results.append({"check": name, "max_abs_err": err, "tol": tol, "pass": err <= tol})
        print(
            f"  {'PASS' if err <= tol else 'FAIL'}  {name:<52} max|err| {err:.3e} (tol {tol:.0e})"
        )

    print("checks against reference.py")
    for seq_lens, num_q, num_kv, head_dim in [
        ([4000], NUM_Q, NUM_KV, HEAD_DIM),
        ([3000, 999, 37], NUM_Q, NUM_KV, HEAD_DIM),
        ([2000, 513], 9, 3, 64),  # SmolLM2-135M's attention shape
    ]:
        q, k, v, cu = _packed(seq_lens, num_q, num_kv, head_dim)
        out, lse = tk.prefill_attention(q, k, v, cu, head_dim**-0.5)
        ref_out, ref_lse = ref.prefill_attention(q, k, v, cu, head_dim**-0.5)
        shape = f"{seq_lens} {num_q}/{num_kv}h d{head_dim}"
        record(f"prefill out {shape}", _max_err(out, ref_out), 3e-2)
        record(f"prefill lse {shape}", _max_err(lse, ref_lse), 1e-3)
        del ref_out, ref_lse

    n, window = 4000, 32
    q, k, v, cu = _packed([n])
    _, lse = tk.prefill_attention(q, k, v, cu, SCALE)
    args = (q[n - window :], k, lse[:, n - window :], SCALE)
    for reduce in ("mean", "max"):
        got = tk.window_scores(*args, gqa_reduce=reduce)
        want = ref.window_scores(*args, gqa_reduce=reduce)
        # Scores are probabilities summed over 32 rows; compare relative to the largest.
        record(
            f"window_scores n={n} w={window} {reduce} (rel)",
            _max_err(got, want) / want.abs().max().item(),
            1e-3,
        )

    for batch, context, cache_dtype in [
        (64, 4500, DTYPE),
        (2, 4500, DTYPE),
        (32, 512, DTYPE),
        (1, 4500, DTYPE),
        (64, 4500, FP8_DTYPE),
    ]:
        lens = (context - torch.randint(0, 64, (batch,))).tolist()
        k_cache, v_cache, table, lens_t = _paged(lens, cache_dtype)
        q = _randn(batch, NUM_Q, HEAD_DIM)
        splits = tk.decode_num_splits(batch, NUM_KV, max(lens), q.device, cache_dtype)
        got = tk.paged_decode_attention(q, k_cache, v_cache, table, lens_t, SCALE)
        want = ref.paged_decode_attention(q, k_cache, v_cache, table, lens_t, SCALE)
        record(
            f"paged_decode {_cache_name(cache_dtype)} cache B={batch} ctx~{context} splits={splits}",
            _max_err(got, want),
            2e-2,
        )

    budget = 512
    k, v = _randn(n, NUM_KV, HEAD_DIM), _randn(n, NUM_KV, HEAD_DIM)
    indices = ref.select_top_tokens(
        torch.rand(NUM_KV, n - window, device=DEVICE), n, budget, window, 4
    )
    record(
        "gather_tokens n=4000 B=512",
        _max_err(tk.gather_tokens(k, indices), ref.gather_tokens(k, indices)),
        0.0,
    )
    slots = torch.randperm(400 * BLOCK_SIZE, device=DEVICE)[:n]
    caches = [
        torch.zeros(400, BLOCK_SIZE, NUM_KV, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(4)
    ]
    tk.store_kv(k, v, caches[0], caches[1], slots)
    ref.store_kv(k, v, caches[2], caches[3], slots)
    record(
        "store_kv n=4000", max(_max_err(caches[0], caches[2]), _max_err(caches[1], caches[3])), 0.0
    )
    kept_slots = slots[:budget]
    tk.store_selected_kv(k, v, indices, caches[0], caches[1], kept_slots)
    ref.store_kv(
        ref.gather_tokens(k, indices),
        ref.gather_tokens(v, indices),
        caches[2],
        caches[3],
        kept_slots,
    )
    record(
        "store_selected_kv n=4000 B=512",
        max(_max_err(caches[0], caches[2]), _max_err(caches[1], caches[3])),
        0.0,
    )
    for lens in ([1000] * 65, [8000] * 8):
        record(
            f"snapkv kept rows, {len(lens)} prompts of {lens[0]} (fraction not the reference's)",
            _selection_mismatch(lens, budget=lens[0] // 4),
            1e-2,
        )
    return results


def _selection_mismatch(lens: list[int], budget: int) -> float:
    """The fraction of SnapKV's kept rows that differ between the GPU path (the prefill
    kernel's LSE, Triton scoring and selection) and the reference path, at the accuracy
    suite's shapes: SmolLM2's 9/3 heads of 64, bf16, a full step of prompts whose first token
    draws most of the attention (as real models' attention sinks do)."""
    from sparse_core.config import SparsityConfig
    from sparse_core.kernels import REFERENCE_OPS, get_ops
    from sparse_core.selection import PromptBatch, selection_policy

    q, k, v, cu = _packed(lens, 9, 3, 64)
    sink = torch.randn(64, device=DEVICE)
    sink = sink / sink.norm() * 8
    q += sink.to(DTYPE)
    k[cu[:-1].long()] = (4 * sink).to(DTYPE)
    scale = 64**-0.5
    _, lse = tk.prefill_attention(q, k, v, cu, scale, max(lens))
    bounds = list(itertools.pairwise(cu.tolist()))
    prompts = PromptBatch.from_bounds(bounds, [budget] * len(bounds), q.device)
    snapkv = SparsityConfig(policy="snapkv", budget=budget)
    got = selection_policy(snapkv, get_ops(q.device)).select(q, k, lse, prompts, scale)
    want = selection_policy(snapkv, REFERENCE_OPS).select(q, k, None, prompts, scale)

    def kept(rows: torch.Tensor) -> torch.Tensor:  # [Hkv, packed keys], True where kept
        mask = torch.zeros(rows.shape[0], k.shape[0], dtype=torch.bool, device=rows.device)
        return mask.scatter_(1, rows, True)

    return (kept(got) & ~kept(want)).sum().item() / got.numel()


# --- 2. timing ----------------------------------------------------------------------------------


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (read + write) of 1 GiB: the decode roofline."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    # Plain do_bench: a copy captured in a graph becomes a memcpy node, measured ~35% slower.
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def bench_prefill(n: int = 4000) -> dict[str, Any]:
    q, k, v, cu = _packed([n])
    ours = _time_ms([lambda: tk.prefill_attention(q, k, v, cu, SCALE, max_seqlen=n)])
    # SDPA wants [1, H, T, D]; the layout change and GQA expansion are done outside the timing.
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    ks, vs = (
        x.repeat_interleave(NUM_Q // NUM_KV, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
        for x in (k, v)
    )
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = _time_ms(
            [lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE)]
        )
    causal_flops = 4 * NUM_Q * HEAD_DIM * n * (n + 1) / 2  # QK^T and PV over the lower triangle
    return {
        "tokens": n,
        "triton_lse_ms": ours,
        "sdpa_flash_ms": sdpa,
        "triton_tflops": causal_flops / ours / 1e9,
        "sdpa_tflops": causal_flops / sdpa / 1e9,
    }


def _scores_by_softmax_rows(q_win: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """SnapKV as usually written: materialise the window's w x n logits, softmax, sum columns."""
    w, n = q_win.shape[0], k.shape[0]
    qs = q_win.transpose(0, 1)  # [Hq, w, D]
    ks = k.transpose(0, 1).repeat_interleave(NUM_Q // NUM_KV, dim=0)  # [Hq, n, D]
    logits = torch.matmul(qs, ks.transpose(1, 2)).float() * scale
    visible = (
        torch.arange(n, device=k.device)[None, :]
        <= torch.arange(n - w, n, device=k.device)[:, None]
    )
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return probs[:, :, : n - w].sum(dim=1).view(NUM_KV, -1, n - w).mean(dim=1)


def bench_scoring(n: int = 4000, window: int = 32, budget: int = 512) -> dict[str, Any]:
    """Scoring and compaction of one layer, against that layer's prefill attention."""
    q, k, v, cu = _packed([n])
    _, lse = tk.prefill_attention(q, k, v, cu, SCALE)
    prefill = _time_ms([lambda: tk.prefill_attention(q, k, v, cu, SCALE, max_seqlen=n)])
    # Each call reads one layer's keys (and values, for compaction): rotate over distinct layers.
    layers = [
        (_randn(n, NUM_KV, HEAD_DIM), _randn(n, NUM_KV, HEAD_DIM))
        for _ in range(_num_copies(2 * k.nbytes))
    ]
    q_win, lse_win = q[n - window :], lse[:, n - window :]
    one_pass = _time_ms([lambda k=k: tk.window_scores(q_win, k, lse_win, SCALE) for k, _ in layers])
    softmax_rows = _time_ms(
        [lambda k=k: _scores_by_softmax_rows(q_win, k, SCALE) for k, _ in layers]
    )
    indices = ref.select_top_tokens(
        torch.rand(NUM_KV, n - window, device=DEVICE), n, budget, window, 4
    )
    caches = [_randn(budget // BLOCK_SIZE, BLOCK_SIZE, NUM_KV, HEAD_DIM) for _ in range(2)]
    slots = torch.arange(budget, device=DEVICE)
    compact = _time_ms(
        [lambda k=k, v=v: tk.store_selected_kv(k, v, indices, *caches, slots) for k, v in layers]
    )
    return {
        "tokens": n,
        "window": window,
        "budget": budget,
        "one_pass_ms": one_pass,
        "softmax_rows_ms": softmax_rows,
        "compaction_ms": compact,
        "prefill_attention_ms": prefill,
        "one_pass_pct_of_prefill_attention": 100 * one_pass / prefill,
    }


def _decode_timer(
    batch: int, context: int, cache_dtype: torch.dtype
) -> tuple[int, Callable[[int], float]]:
    """(K+V bytes a call reads, ms per call at a given split count) of paged decode over `batch`
    contexts of `context` tokens. One cache per "layer", as a decode step walks the layers;
    together they exceed L2."""
    kv_bytes = 2 * batch * context * NUM_KV * HEAD_DIM * cache_dtype.itemsize
    layers = [_paged([context] * batch, cache_dtype) for _ in range(_num_copies(kv_bytes))]
    q = _randn(batch, NUM_Q, HEAD_DIM)

    def run(num_splits: int) -> float:
        # max_context_len and num_splits given: no host sync, so the calls are graph-capturable.
        decode = functools.partial(
            tk.paged_decode_attention, max_context_len=context, num_splits=num_splits
        )
        return _time_ms([functools.partial(decode, q, *layer, SCALE) for layer in layers])

    return kv_bytes, run


def bench_decode(
    batch: int, context: int, copy_gbs: float, cache_dtype: torch.dtype = DTYPE
) -> dict[str, Any]:
    kv_bytes, run = _decode_timer(batch, context, cache_dtype)
    splits = tk.decode_num_splits(batch, NUM_KV, context, torch.device(DEVICE), cache_dtype)
    ms = run(splits)
    ms_no_split = run(1) if splits > 1 else ms
    gbs = kv_bytes / ms / 1e6
    return {
        "cache": _cache_name(cache_dtype),
        "batch": batch,
        "context": context,
        "splits": splits,
        "ms": ms,
        "ms_no_split": ms_no_split,
        "kv_mb": kv_bytes / 1e6,
        "gb_per_s": gbs,
        "roofline_frac": gbs / copy_gbs,
    }


# The split counts the sweep times, and the batches it times them at (FP8 cache, where the rule
# counts waves of programs: sparse_core/kernels/triton_kernels.py, decode_num_splits).
SPLIT_SWEEP = (1, 2, 3, 4, 6, 8)
SPLIT_SWEEP_BATCHES = (8, 16, 20, 32, 40, 46, 56)


def bench_decode_splits(batch: int, context: int, cache_dtype: torch.dtype) -> dict[str, Any]:
    """Paged decode at every count of SPLIT_SWEEP, beside the count the engine picks."""
    _, run = _decode_timer(batch, context, cache_dtype)
    chosen = tk.decode_num_splits(batch, NUM_KV, context, torch.device(DEVICE), cache_dtype)
    return {"cache": _cache_name(cache_dtype), "batch": batch, "context": context,
            "chosen": chosen, "us": {n: 1e3 * run(n) for n in SPLIT_SWEEP}}  # fmt: skip


# Llama-3-8B's FP8 projections (in features, out features): qkv, o, gate_up, down.
LINEAR_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                 "down": (14336, 4096)}  # fmt: skip


# The routes of `fp8_linear_cuda`, as the few_rows_max that takes each for `rows` rows.
FP8_LINEAR_ROUTES = {"row_wise": lambda rows: 0, "few_rows": lambda rows: rows}


def bench_fp8_linear(rows: int, copy_gbs: float) -> list[dict[str, Any]]:
    """Every route of `fp8_linear_cuda` at `rows` tokens (activations quantized included), each
    checked against the row-wise one first."""
    results = []
    for name, (k, n) in LINEAR_SHAPES.items():
        weights = [quantize_rows(_randn(n, k)) for _ in range(_num_copies(n * k))]
        x = _randn(rows, k)
        out = torch.empty(rows, n, device=DEVICE, dtype=DTYPE)
        row = {"layer": name, "rows": rows, "in": k, "out": n}
        want = None
        for route, few_rows_max_for in FP8_LINEAR_ROUTES.items():
            calls = [
                functools.partial(triton_fp8.fp8_linear_cuda, x, w, s, out, few_rows_max_for(rows))
                for w, s in weights
            ]
            calls[0]()
            if want is None:
                want = out.clone().float()
            row[f"{route}_rel_diff"] = (out.float() - want).norm().item() / want.norm().item()
            ms = _time_ms(calls)
            row[f"{route}_us"] = ms * 1e3
            row[f"{route}_roofline_frac"] = n * k / ms / 1e6 / copy_gbs
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}")
    checks = [] if args.skip_checks else run_checks()

    copy_gbs = copy_bandwidth_gbs()
    prefill = bench_prefill()
    scoring = bench_scoring()
    decode = [
        bench_decode(b, c, copy_gbs, dtype)
        for dtype in (DTYPE, FP8_DTYPE)
        for c in (4500, 512)
        for b in (1, 8, 32, 64, 128)
    ]
    splits = [
        bench_decode_splits(b, c, FP8_DTYPE) for c in (4500, 1012) for b in SPLIT_SWEEP_BATCHES
    ]
    fp8_linear = [
        r
        for rows in (1, 16, 49, 64, 96, 128, 160, 192, 256)
        for r in bench_fp8_linear(rows, copy_gbs)
    ]

    print(f"\ndevice copy bandwidth: {copy_gbs:.0f} GB/s")
    print(
        f"prefill {prefill['tokens']} tok: triton+LSE {prefill['triton_lse_ms']:.3f} ms "
        f"({prefill['triton_tflops']:.0f} TFLOP/s) | SDPA flash {prefill['sdpa_flash_ms']:.3f} ms "
        f"({prefill['sdpa_tflops']:.0f} TFLOP/s)"
    )
    print(
        f"window scores n={scoring['tokens']} w={scoring['window']}: one pass {scoring['one_pass_ms']:.3f} ms "
        f"({scoring['one_pass_pct_of_prefill_attention']:.1f}% of prefill attention) | "
        f"softmax rows {scoring['softmax_rows_ms']:.3f} ms | compaction {scoring['compaction_ms']:.3f} ms"
    )
    print(f"\npaged decode (32q/8kv heads, d128, bf16 queries, {BLOCK_SIZE}-token pages)")
    print(
        f"{'cache':>5} {'batch':>6} {'ctx':>6} {'splits':>6} {'µs':>8} {'unsplit µs':>10} "
        f"{'GB/s':>6} {'roofline':>8}"
    )
    for r in decode:
        print(
            f"{r['cache']:>5} {r['batch']:>6} {r['context']:>6} {r['splits']:>6} "
            f"{r['ms'] * 1e3:>8.1f} {r['ms_no_split'] * 1e3:>10.1f} {r['gb_per_s']:>6.0f} "
            f"{r['roofline_frac']:>8.0%}"
        )
    print("\npaged decode by split count, µs (the engine's count marked *)")
    print(f"{'cache':>5} {'batch':>6} {'ctx':>6} " + " ".join(f"{n:>7}" for n in SPLIT_SWEEP))
    for r in splits:
        cells = (f"{t:.1f}{'*' if n == r['chosen'] else ''}" for n, t in r["us"].items())
        print(
            f"{r['cache']:>5} {r['batch']:>6} {r['context']:>6} "
            + " ".join(f"{c:>7}" for c in cells)
        )
    print("\nFP8 linear, µs per call (fraction of the roofline): by route of fp8_linear_cuda")
    print(f"{'layer':>8} {'rows':>5} " + " ".join(f"{route:>15}" for route in FP8_LINEAR_ROUTES))
    for r in fp8_linear:
        cells = (
            f"{r[f'{route}_us']:>7.1f} ({r[f'{route}_roofline_frac']:>4.0%})"
            for route in FP8_LINEAR_ROUTES
        )
        print(f"{r['layer']:>8} {r['rows']:>5} " + " ".join(f"{c:>15}" for c in cells))
    failed = [c["check"] for c in checks if not c["pass"]]
    if checks:
        fails = f"; FAIL: {', '.join(failed)}" if failed else ""
        print(f"\nchecks: {len(checks) - len(failed)}/{len(checks)} PASS{fails}")

    if args.json:
        report = {
            "device": props.name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "checks": checks,
            "copy_gb_per_s": copy_gbs,
            "prefill": prefill,
            "scoring": scoring,
            "decode": decode,
            "decode_splits": splits,
            "fp8_linear": fp8_linear,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

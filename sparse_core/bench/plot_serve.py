"""Plot `kvsparse bench serve --output` reports side by side: output tokens/s and TTFT p50 against
concurrency. Stock vLLM sweeps (the JSON line its peer `sweep.py` prints last; bf16 and fp8/fp8, say)
can go beside them.
With --per-request, every request's TTFT instead, in ascending order, one panel per concurrency
level: where a median sits among the rounds of a closed loop.

python -m sparse_core.bench.plot_serve OUT.png REPORT.json [REPORT.json ...]
    [--vllm-sweep SWEEP.json ...] [--labels "A,B,..."] [--per-request [--target SECONDS]]
"""

from __future__ import annotations

import argparse
import json

from sparse_core.plotting import pyplot, save


def load_report(path: str) -> tuple[str, list[dict]]:
    with open(path) as f:
        report = json.load(f)
    return report.get("label") or report["model"], report["levels"]


def load_vllm_sweep(path: str) -> tuple[str, list[dict]]:
    """`{"vllm_ttft_sweep": {"rows": [{concurrency, output_tok_per_s, ttft_p50_s, ...}], ...}}`,
    labelled with its weights and KV cache dtypes (bf16 where the sweep names none)."""
    with open(path) as f:
        sweep = json.load(f)["vllm_ttft_sweep"]
    weights = sweep.get("quantization") or "bf16"
    kv = sweep.get("kv_cache_dtype") or "bf16"
    return f"stock vLLM 0.24 {weights}/{kv} (in-process)", sweep["rows"]


def plot_per_request(plt, runs: list[tuple[str, list[dict]]], target: float | None):
    """One panel per concurrency level: each report's TTFTs, request by request, ascending."""
    levels = sorted({lv["concurrency"] for _, run in runs for lv in run})
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4.2), squeeze=False)
    for ax, concurrency in zip(axes[0], levels, strict=True):
        for label, run in runs:
            for lv in run:
                if lv["concurrency"] == concurrency:
                    ttfts = sorted(r["ttft_s"] for r in lv["request_results"])
                    median = lv["ttft_p50_s"]
                    ax.plot(range(1, len(ttfts) + 1), ttfts, ".-",
                            label=f"{label} (p50 {median:.3f} s)")  # fmt: skip
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"{target:g} s")
        ax.set_yscale("log")
        ax.set_xlabel("request, by TTFT")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{concurrency} clients: every request's TTFT")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--vllm-sweep", action="append", default=[],
                        help="a stock vLLM sweep's JSON; repeat for several")  # fmt: skip
    parser.add_argument("--labels", default=None, help="comma-separated, one per report")
    parser.add_argument("--title", default="")
    parser.add_argument("--per-request", action="store_true",
                        help="every request's TTFT per level instead of the sweep's curves")  # fmt: skip
    parser.add_argument("--target", type=float, default=None,
                        help="with --per-request: a TTFT to draw as a line, in seconds")  # fmt: skip
    args = parser.parse_args(argv)
    if args.per_request and args.vllm_sweep:
        parser.error("--per-request needs each request's results, which --vllm-sweep has not")
    if args.target is not None and not args.per_request:
        parser.error("--target draws a line on the --per-request plot")

    plt = pyplot()
    runs = [load_report(path) for path in args.reports]
    for path, (_, levels) in zip(args.reports, runs, strict=True):
        if any(lv.get("concurrency") is None for lv in levels):
            parser.error(f"{path} is an open-loop (--request-rate) report; this plots concurrency")
    if args.labels:
        labels = args.labels.split(",")
        if len(labels) != len(runs):
            parser.error(f"--labels has {len(labels)} names for {len(runs)} reports")
        runs = [(label, levels) for label, (_, levels) in zip(labels, runs, strict=True)]
    if args.per_request:
        save(plot_per_request(plt, runs, args.target), args.out, dpi=110, title=args.title)
        return
    runs = [load_vllm_sweep(path) for path in args.vllm_sweep] + runs
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.4))
    for label, levels in runs:
        conc = [lv["concurrency"] for lv in levels]
        tput.plot(conc, [lv["output_tok_per_s"] for lv in levels], "o-", label=label)
        ttft.plot(conc, [lv["ttft_p50_s"] for lv in levels], "o-", label=label)
    tput.set_ylabel("output tokens/s")
    tput.set_title("Throughput against concurrency")
    ttft.set_ylabel("TTFT p50 (s)")
    ttft.set_yscale("log")
    ttft.set_title("Time to first token against concurrency")
    for ax in (tput, ttft):
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, args.out, dpi=110, title=args.title)


if __name__ == "__main__":
    main()

"""Plot `kvsparse bench throughput --json` results: decode tokens/s per concurrent batch size for
each run, and end-to-end output tokens/s beside an optional peer figure.

python -m sparse_core.bench.plot_throughput RESULTS.json OUT.png [--peer "stock vLLM 0.24=1257"]
"""

from __future__ import annotations

import argparse
import json

from sparse_core.plotting import pyplot, save


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("out")
    parser.add_argument("--peer", action="append", default=[], help='"label=output tok/s"')
    parser.add_argument("--title", default="")
    args = parser.parse_args()

    plt = pyplot()
    with open(args.results) as f:
        runs = json.load(f)["results"]
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(11, 4.4))
    for run in runs:
        # Batch sizes seen for only a few steps (ramp-up, drain) are noise.
        rows = [r for r in run["decode_by_batch"] if r["steps"] >= 10]
        curve.plot(
            [r["batch"] for r in rows], [r["tok_s"] for r in rows], "o-", ms=3, label=run["label"]
        )
    curve.set_xlabel("concurrent sequences in a decode step")
    curve.set_ylabel("decode tokens/s")
    curve.set_title("Decode throughput against concurrency")
    curve.grid(alpha=0.3)
    curve.legend()

    peers = [p.rsplit("=", 1) for p in args.peer]
    labels = [label for label, _ in peers] + [r["label"] for r in runs]
    values = [float(v) for _, v in peers] + [r["output_tok_s"] for r in runs]
    drawn = bars.bar(
        [label.replace(" ", "\n", 1) for label in labels],
        values,
        color=["tab:red"] * len(peers) + ["tab:blue"] * len(runs),
    )
    bars.bar_label(drawn, fmt="%.0f")
    bars.set_ylabel("output tokens/s")
    bars.set_title("End to end")
    bars.tick_params(axis="x", labelsize=8)
    save(fig, args.out, dpi=110, title=args.title)


if __name__ == "__main__":
    main()

"""Summaries of a sweep: accuracy per configuration and length, markdown tables, the plot."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean

from sparse_core.eval.runner import SampleResult


@dataclass
class Row:
    config: str
    accuracy: dict[int, float]  # length -> mean score (percent)
    overall: float
    compression: float  # mean effective compression over all layers
    num_samples: int


def summarize(results: list[SampleResult], by: str = "length") -> list[Row]:
    """One row per configuration, in first-seen order; columns keyed by `by` (length or task)."""
    groups: dict[str, list[SampleResult]] = defaultdict(list)
    for r in results:
        groups[r.config].append(r)
    rows = []
    for config, rs in groups.items():
        cols: dict = defaultdict(list)
        for r in rs:
            cols[getattr(r, by)].append(r.score)
        rows.append(
            Row(
                config=config,
                accuracy={k: 100 * mean(v) for k, v in cols.items()},
                overall=100 * mean(r.score for r in rs),
                compression=mean(r.compression for r in rs),
                num_samples=len(rs),
            )
        )
    return rows


def markdown_table(rows: list[Row], column_title: str = "length") -> str:
    keys = sorted({k for row in rows for k in row.accuracy}, key=str)
    head = ["config", "effective compression", *(f"{column_title} {k}" for k in keys), "all"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.config, f"{row.compression:.2f}x"]
        cells += [f"{row.accuracy[k]:.1f}" if k in row.accuracy else "" for k in keys]
        cells.append(f"**{row.overall:.1f}**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str) -> None:
    """Accuracy against effective compression, one line per policy (the part before '@')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    dense = None
    for row in rows:
        policy = row.config.split("@")[0]
        if policy == "dense":
            dense = row.overall
        else:
            lines[policy].append((row.compression, row.overall))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, points in lines.items():
        points.sort()
        ax.plot(*zip(*points, strict=True), marker="o", label=policy)
    if dense is not None:
        ax.axhline(dense, color="black", linestyle="--", label="dense")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("effective KV compression over all layers (x)")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

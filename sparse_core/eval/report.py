"""Summaries of a sweep: accuracy per configuration and length, markdown tables, the plot."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean

from sparse_core.eval.runner import SampleResult
from sparse_core.plotting import pyplot, save


@dataclass
class Row:
    config: str
    setting: str  # query-aware | query-agnostic
    accuracy: dict[int, float]  # length -> mean score (percent)
    overall: float
    compression: float  # mean effective compression over all layers
    num_samples: int


def summarize(results: list[SampleResult], by: str = "length") -> list[Row]:
    """One row per (setting, configuration), in first-seen order; columns keyed by `by` (length
    or task)."""
    groups: dict[tuple[str, str], list[SampleResult]] = defaultdict(list)
    for r in results:
        groups[r.setting, r.config].append(r)
    rows = []
    for (setting, config), rs in groups.items():
        cols: dict = defaultdict(list)
        for r in rs:
            cols[getattr(r, by)].append(r.score)
        rows.append(
            Row(
                config=config,
                setting=setting,
                accuracy={k: 100 * mean(v) for k, v in cols.items()},
                overall=100 * mean(r.score for r in rs),
                compression=mean(r.compression for r in rs),
                num_samples=len(rs),
            )
        )
    return rows


def settings_of(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(row.setting for row in rows))


def markdown_table(rows: list[Row], column_title: str = "length") -> str:
    """One line per row; a setting column when the rows hold more than one setting."""
    with_setting = len(settings_of(rows)) > 1
    keys = sorted({k for row in rows for k in row.accuracy}, key=str)
    head = ["config", *(["setting"] if with_setting else []), "effective compression"]
    head += [*(f"{column_title} {k}" for k in keys), "all"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    configs = list(dict.fromkeys(row.config for row in rows))
    settings = settings_of(rows)
    # Each configuration's settings on consecutive lines.
    for row in sorted(rows, key=lambda r: (configs.index(r.config), settings.index(r.setting))):
        cells = [row.config, *([row.setting] if with_setting else []), f"{row.compression:.2f}x"]
        cells += [f"{row.accuracy[k]:.1f}" if k in row.accuracy else "" for k in keys]
        cells.append(f"**{row.overall:.1f}**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settings_table(rows: list[Row]) -> str:
    """The settings side by side: one line per configuration, accuracy and effective
    compression in each setting."""
    settings = settings_of(rows)
    by_key = {(row.config, row.setting): row for row in rows}
    configs = list(dict.fromkeys(row.config for row in rows))
    head = ["config", *(f"{s} accuracy (%)" for s in settings)]
    head += [f"{s} effective" for s in settings]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config in configs:
        cells = [config]
        found = [by_key.get((config, s)) for s in settings]
        cells += [f"**{r.overall:.1f}**" if r else "" for r in found]
        cells += [f"{r.compression:.2f}x" if r else "" for r in found]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str) -> None:
    """Accuracy against effective compression, one line per policy (the part before '@'), one
    panel per query setting."""
    plt = pyplot()
    settings = settings_of(rows)
    fig, axes = plt.subplots(
        1, len(settings), figsize=(7 * len(settings), 4.5), sharey=True, squeeze=False
    )
    for ax, setting in zip(axes[0], settings, strict=True):
        lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
        dense = None
        for row in rows:
            if row.setting != setting:
                continue
            policy = row.config.split("@")[0]
            if policy == "dense":
                dense = row.overall
            else:
                lines[policy].append((row.compression, row.overall))
        for policy, points in lines.items():
            points.sort()
            ax.plot(*zip(*points, strict=True), marker="o", label=policy)
        if dense is not None:
            ax.axhline(dense, color="black", linestyle="--", label="dense")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("effective KV compression over all layers (x)")
        ax.set_ylim(0, 100)
        ax.set_title(setting)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("accuracy (%)")
    save(fig, path, dpi=120, title=title)

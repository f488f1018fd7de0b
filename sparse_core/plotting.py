"""Headless matplotlib for the benchmark and accuracy plots.

matplotlib comes with the `bench` extra; it is imported only when a plot is drawn.
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend: writes files, needs no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str, dpi: int, title: str = "") -> None:
    """Title (if any), lay out, write the figure to `path` and release it."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)

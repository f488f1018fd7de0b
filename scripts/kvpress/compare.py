"""Side-by-side table of our engine's and kvpress's accuracy on the same samples.

python scripts/kvpress/compare.py OURS.json KVPRESS.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sparse_core.eval.report import summarize
from sparse_core.eval.runner import SampleResult


def main() -> None:
    ours, theirs = (
        {
            r.config: r
            for r in summarize([SampleResult(**d) for d in json.loads(Path(p).read_text())])
            if r.setting == "query-aware"  # kvpress.json is query-aware only
        }
        for p in sys.argv[1:3]
    )
    print("| config | kvsparse | kvsparse effective | kvpress |")
    print("|---|---|---|---|")
    for name in [*ours, *(n for n in theirs if n not in ours)]:
        a, b = ours.get(name), theirs.get(name)
        cells = [
            f"{a.overall:.1f}" if a else "",
            f"{a.compression:.2f}x" if a else "",
            f"{b.overall:.1f}" if b else "",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

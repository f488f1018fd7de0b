"""Checks that the serving image's Python dependencies resolve for the image: every package of
the Dockerfile's extras (`ARG EXTRAS`), pinned by constraints.txt, as a binary wheel for the
image's Python (Ubuntu 24.04's CPython 3.12, manylinux x86_64). torch (and triton, which follows
its build) is the Dockerfile's `TORCH` argument and is left out.

It stands in for building the image where no container registry is reachable. pip resolves
without installing or downloading the wheels (a dry run reads their metadata), so it needs the
package index:

    python3 scripts/check_image_deps.py      # prints the packages, exits 1 if any fails
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON_VERSION = "3.12"  # Ubuntu 24.04's python3, which the Dockerfile installs
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
HOST_CHOSEN = ("torch", "triton")  # the Dockerfile's TORCH argument and what follows it


def image_requirements() -> list[str]:
    """The project's dependencies and the Dockerfile's default extras', torch's aside."""
    extras = re.search(r"^ARG EXTRAS=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert extras, "the Dockerfile has no ARG EXTRAS"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    names = project["dependencies"] + [r for e in extras.group(1).split(",") for r in optional[e]]
    return [r for r in names if re.split(r"[\[<>=! ;]", r, maxsplit=1)[0] not in HOST_CHOSEN]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        command = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
            "--report", str(report), "--target", str(Path(tmp) / "target"),
            "--python-version", PYTHON_VERSION, *platforms, "--only-binary=:all:",
            "-c", str(ROOT / "constraints.txt"), *image_requirements(),
        ]  # fmt: skip
        if subprocess.run(command).returncode != 0:
            print("the image's dependencies do not resolve (above)", file=sys.stderr)
            return 1
        installs = json.loads(report.read_text())["install"]
    for item in sorted(installs, key=lambda i: i["metadata"]["name"].lower()):
        print(f"{item['metadata']['name']}=={item['metadata']['version']}")
    print(
        f"{len(installs)} packages, all binary wheels for CPython {PYTHON_VERSION}", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

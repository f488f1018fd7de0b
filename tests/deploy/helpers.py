"""Helpers for the deployment tests: helm from PATH or .tools/bin (scripts/install_tools.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvsparse"


def find_helm() -> str | None:
    local = ROOT / ".tools" / "bin" / "helm"
    if local.is_file():
        return str(local)
    return shutil.which("helm")


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        pytest.skip("helm not found on PATH or in .tools/bin (run scripts/install_tools.sh)")
    return path


def set_args(values: dict[str, Any], prefix: str = "") -> list[str]:
    """`--set-json` arguments for nested values."""
    import json

    args = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            args += set_args(value, name + ".")
        else:
            args += ["--set-json", f"{name}={json.dumps(value)}"]
    return args


def run_helm(helm: str, *args: str) -> str:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def render(helm: str, values: dict[str, Any], *extra: str) -> list[dict[str, Any]]:
    out = run_helm(helm, "template", "kvsparse", str(CHART), "--namespace", "default",
                   *set_args(values), *extra)  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]

"""The vLLM releases the plugin is written against; others are refused with a clear message."""

from __future__ import annotations

import re

# [lowest, first unsupported) ranges: 0.24.x (the release built for torch 2.11), 0.32.x and
# 0.33.x. What differs between them is in compat.py.
SUPPORTED = (((0, 24), (0, 25)), ((0, 32), (0, 34)))


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(f"kvsparse: cannot parse the vLLM version {version!r}")
    return int(match[1]), int(match[2])


def check_vllm_version(version: str) -> None:
    found = release(version)
    if not any(low <= found < high for low, high in SUPPORTED):
        ranges = " and ".join(
            f"{low[0]}.{low[1]}"
            + ("" if high == (low[0], low[1] + 1) else f" to {high[0]}.{high[1] - 1}")
            for low, high in SUPPORTED
        )
        raise RuntimeError(
            f"kvsparse's vLLM plugin supports vLLM {ranges}, "
            f"but vLLM {version} is installed; install a supported release "
            f"(pip install 'kvsparse[vllm]') or uninstall kvsparse from this environment"
        )

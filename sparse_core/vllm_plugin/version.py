"""The vLLM releases the plugin is written against; others are refused with a clear message."""

from __future__ import annotations

import re

SUPPORTED = ((0, 32), (0, 34))  # [lowest, first unsupported): 0.32.x and 0.33.x


def check_vllm_version(version: str) -> None:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(f"kvsparse: cannot parse the vLLM version {version!r}")
    found = (int(match[1]), int(match[2]))
    low, high = SUPPORTED
    if not low <= found < high:
        raise RuntimeError(
            f"kvsparse's vLLM plugin supports vLLM {low[0]}.{low[1]} to {high[0]}.{high[1] - 1}, "
            f"but vLLM {version} is installed; install a supported release "
            f"(pip install 'kvsparse[vllm]') or uninstall kvsparse from this environment"
        )

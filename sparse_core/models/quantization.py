"""`EngineConfig.quantization`: where FP8 weights can run."""

from __future__ import annotations

import torch

from sparse_core.kernels.fp8 import supports_fp8


def check_fp8_device(device: torch.device, setting: str) -> None:
    """FP8 runs on FP8 tensor cores, or on the CPU through the reference (for tests); a GPU
    without them is refused at start-up rather than run slower than bf16. `setting` names what
    asked for FP8, for the message (e.g. "quantization='fp8'")."""
    if device.type == "cuda" and not supports_fp8(device):
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"{setting} needs a GPU with FP8 support (compute capability 8.9 or higher: Ada "
            f"such as the RTX 4090, Hopper); {name} has {major}.{minor}. Run without it: "
            f"--quantization none --kv-cache-dtype auto (the Helm chart: engine.quantization "
            f"null and engine.kv_cache_dtype auto)"
        )

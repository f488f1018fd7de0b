"""Where an engine runs: its device and dtype from the config's names, and the host threads of a
process that drives a device."""

from __future__ import annotations

import os

import torch

from sparse_core.config import EngineConfig
from sparse_core.kernels.fp8 import supports_fp8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | None) -> torch.device:
    """`EngineConfig.device`: None is CUDA where there is a GPU, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def config_on_device(config: EngineConfig) -> EngineConfig:
    """`config` with the defaults that depend on its device filled in (EngineConfig.on_device)."""
    device = resolve_device(config.device)
    return config.on_device(device.type, supports_fp8(device))


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`EngineConfig.dtype`: None is bfloat16 on CUDA, float32 elsewhere."""
    if name is None:
        # CPU matmuls in bf16 are slow and lose the exact match with reference outputs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def use_one_host_thread() -> None:
    """For a process that drives a GPU: one torch CPU thread, unless OMP_NUM_THREADS says
    otherwise. Its host work is tiny tensors, on which a pool of threads (torch's default: one
    per core) only spins against the other processes of a server, and every decode step waits
    on it (docs/benchmarks.md, "Engine internals")."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def set_rank_threads(device: torch.device, world_size: int) -> None:
    """A tensor-parallel worker rank's torch threads: one on a GPU (`use_one_host_thread`); on
    the CPU, where the ranks compute, an equal share of the cores each."""
    if device.type == "cuda":
        use_one_host_thread()
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

"""What this process holds on a GPU, CUDA context included.

`EngineConfig.gpu_memory_limit_gb` caps the whole process (torch's allocator, the CUDA context,
library workspaces), as a card of that size would hold it. Where NVML can say what each process
holds, other processes on the same GPU (a second engine replica sharing it) do not count against
the cap; they only take from the memory that is free. Where it cannot, everything in use on the
GPU beyond torch's allocator is counted as this process's, which can only err on the safe side.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass

import torch


def process_gpu_bytes(device: torch.device) -> int | None:
    """Bytes NVML reports for this process on `device`, or None where it cannot tell (no NVML,
    no per-process accounting, or the process not listed yet)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            uuid = torch.cuda.get_device_properties(_index(device)).uuid
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or refusing per-process queries (some VMs, containers)
        return None
    return None


def gpu_memory_outside_torch(device: torch.device) -> int:
    """Bytes this process holds on the GPU beyond torch's allocator: the CUDA context and library
    workspaces (all memory in use beyond the allocator, where NVML cannot tell processes apart)."""
    reserved = torch.cuda.memory_reserved(device)
    own = process_gpu_bytes(device)
    if own is not None:
        return max(own - reserved, 0)
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) - reserved


def peak_process_gpu_bytes(device: torch.device) -> int:
    """This process's peak on the GPU: torch's allocator at its peak (CUDA graph pools included)
    plus what it holds outside the allocator now."""
    return torch.cuda.max_memory_reserved(device) + gpu_memory_outside_torch(device)


@functools.cache
def _hold_nvml() -> None:
    """Keep NVML initialised for the life of the process, so that each later query's
    nvmlInit / nvmlShutdown pair only counts references instead of attaching to the driver
    again."""
    with contextlib.suppress(Exception):  # no NVML: queries fall back, as they would anyway
        import pynvml

        pynvml.nvmlInit()


@dataclass
class PeakGpuMemoryMeter:
    """`peak_process_gpu_bytes` for an engine that reports its state every step: measured at
    most once per `interval_s` (the allocator's statistics and NVML's per-process query are
    not free), the last measurement in between. None off CUDA."""

    device: torch.device
    interval_s: float = 1.0
    _bytes: int | None = None
    _measured_at: float = float("-inf")

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            _hold_nvml()

    def read(self) -> int | None:
        if self.device.type != "cuda":
            return None
        now = time.monotonic()
        if now - self._measured_at >= self.interval_s:
            self._bytes, self._measured_at = peak_process_gpu_bytes(self.device), now
        return self._bytes


def limit_allocator(device: torch.device, max_bytes: int | None) -> None:
    """Torch's allocator on `device` holds at most `max_bytes` (None: as much as the device has):
    past it, it frees its cached blocks and retries before it reports out of memory."""
    if device.type != "cuda":
        return
    total = torch.cuda.mem_get_info(device)[1]
    fraction = 1.0 if max_bytes is None else min(max(max_bytes, 0) / total, 1.0)
    torch.cuda.set_per_process_memory_fraction(fraction, _index(device))


def _index(device: torch.device) -> int:
    """The CUDA device's index: "cuda" alone means the current device (some torch calls take
    only an index)."""
    return device.index if device.index is not None else torch.cuda.current_device()

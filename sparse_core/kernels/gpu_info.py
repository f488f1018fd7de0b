"""What the kernels' host wrappers ask of the GPU, looked up once per device: they ask on every
call, and an eager step makes hundreds."""

from __future__ import annotations

import functools

import torch


@functools.cache
def gpu_properties(device: torch.device):
    """The GPU's properties (compute capability, SM count)."""
    return torch.cuda.get_device_properties(device)


def has_large_shared_memory(device: torch.device) -> bool:
    """Data-centre GPUs (sm_90, sm_100) give a program 227 KB of shared memory; Ada (sm_89, the
    RTX 4090) and consumer Blackwell about 99 KB."""
    return gpu_properties(device).major in (9, 10)

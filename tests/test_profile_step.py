"""`sparse_core.bench.profile_step`'s account of where the GPU waited in a step (the script
itself needs CUDA; its arithmetic is checked here on profiler-shaped events)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparse_core.bench.profile_step import STEP_MARKER, device_idle

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def event(name: str, device, start_us: float, end_us: float) -> SimpleNamespace:
    return SimpleNamespace(
        name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us)
    )


def test_idle_time_before_between_and_after_the_kernels():
    events = [
        event(STEP_MARKER, CPU, 1000, 2000),
        event(STEP_MARKER, CUDA, 1300, 1900),  # the marker's span on the GPU: not a kernel
        event("aten::mm", CPU, 1100, 1150),
        event("gemm", CUDA, 1300, 1500),
        event("gemm", CUDA, 1300, 1500),  # the same kernel listed twice counts once
        event("rms_norm", CUDA, 1510, 1600),  # 10 us after: launch latency, not idle
        event("attention", CUDA, 1550, 1700),  # overlaps the one before
        event("sample", CUDA, 1800, 1900),  # 100 us after the busy span's end
    ]
    idle = device_idle(events)
    assert idle.before_first == pytest.approx(300e-6)
    assert idle.between == pytest.approx(100e-6)
    assert idle.longest == pytest.approx(100e-6)
    assert idle.after_last == pytest.approx(100e-6)

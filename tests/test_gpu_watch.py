"""The benchmarks' GPU memory watch: what a step's processes hold at once, from NVML."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from sparse_core.bench.gpu_watch import GIB, DeviceMemoryWatch, nvml_available

WATCH = [sys.executable, "-m", "sparse_core.bench.gpu_watch"]
needs_nvml = pytest.mark.skipif(
    not (torch.cuda.is_available() and nvml_available()), reason="needs CUDA and NVML"
)


@pytest.mark.skipif(nvml_available(), reason="a machine without a GPU")
def test_without_a_gpu_it_says_so_and_exits(tmp_path):
    """bench_gpu.sh starts one beside every step, also where there is nothing to watch: it must
    return at once rather than wait for a signal, and claim no figure."""
    out = tmp_path / "peak.json"
    proc = subprocess.run(
        [*WATCH, "--json", str(out)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0
    assert "nothing measured" in proc.stderr
    assert not out.exists()


@needs_nvml
@pytest.mark.gpu
def test_peak_counts_an_allocation_above_the_baseline():
    device = torch.device("cuda")
    torch.empty(1, device=device)  # the CUDA context is in the baseline
    torch.cuda.synchronize()
    with DeviceMemoryWatch(interval_s=0.02) as watch:
        block = torch.empty(GIB, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        time.sleep(0.3)
        del block
        torch.cuda.empty_cache()
        time.sleep(0.1)
    assert watch.samples >= 5
    assert GIB <= watch.peak_bytes < 1.25 * GIB


@needs_nvml
@pytest.mark.gpu
def test_command_line_writes_the_peak_when_interrupted(tmp_path):
    out = tmp_path / "peak.json"
    proc = subprocess.Popen([*WATCH, "--json", str(out)], stdout=subprocess.PIPE, text=True)
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    report = json.loads(out.read_text())
    assert report["samples"] > 0 and report["gpu_memory_peak_gib"] >= 0
    assert "GPU memory peak" in stdout

"""The most GPU memory a benchmark's processes held at once, CUDA contexts included, as a card of
that size would have to hold it.

    python -m sparse_core.bench.gpu_watch [--device 0] [--interval 0.2] [--json OUT.json]

samples the device's memory in use (NVML) until it is interrupted (SIGINT or SIGTERM), then
prints the peak above what was in use when it started and writes it to `--json`.
`scripts/bench_gpu.sh` runs one beside each step: engines that run in processes of their own
(stock vLLM and its engine-core process, vLLM with the plugin, a Ray cluster) report no such
figure themselves, and vLLM's `gpu_memory_utilization` is the budget its own memory profiling
keeps to, not a measurement of the processes. The device's figure counts every process on it, so
it is the step's only while nothing else runs on that GPU.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType

GIB = 1024**3


@dataclass
class DeviceMemoryWatch:
    """Samples `device`'s memory in use every `interval_s` on a thread of its own while open.
    `peak_bytes` is the most in use above `baseline_bytes`, what was in use when it opened."""

    device: int = 0
    interval_s: float = 0.2
    baseline_bytes: int = 0
    peak_bytes: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> DeviceMemoryWatch:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(self.device)
        self.baseline_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        self._thread = threading.Thread(target=self._sample, args=(handle,), daemon=True)
        self._thread.start()
        return self

    def _sample(self, handle: object) -> None:
        import pynvml

        while True:
            used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
            self.peak_bytes = max(self.peak_bytes, used - self.baseline_bytes)
            self.samples += 1
            if self._stop.wait(self.interval_s):
                return

    def __exit__(self, *exc: object) -> None:
        import pynvml

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        pynvml.nvmlShutdown()

    def report(self) -> dict[str, float | int]:
        return {
            "gpu_memory_peak_gib": round(self.peak_bytes / GIB, 2),
            "gpu_memory_baseline_gib": round(self.baseline_bytes / GIB, 2),
            "samples": self.samples,
        }


def nvml_available() -> bool:
    """Whether NVML is there and sees a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no library, no driver, no device
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=int, default=0, help="NVML's index of the GPU")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--json", default=None, help="write the peak here")
    args = p.parse_args(argv)
    if not nvml_available():
        print("gpu_watch: no GPU that NVML can see; nothing measured", file=sys.stderr)
        return 0
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    with DeviceMemoryWatch(args.device, args.interval) as watch:
        stop.wait()
    report = watch.report()
    print(
        f"GPU memory peak {report['gpu_memory_peak_gib']} GiB above the "
        f"{report['gpu_memory_baseline_gib']} GiB in use before ({report['samples']} samples)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

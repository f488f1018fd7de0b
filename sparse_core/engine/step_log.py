"""`EngineConfig.step_log`: every engine step as one JSON line, a timeline to see where latency
goes (which steps ran, how long each took, how long the host took to launch it, whether it paid
for a kernel's first launch)."""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    """One step, for benchmarks: what ran and how long it took (wall clock, device included)."""

    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    kv_token_layers: int  # cached token-layers the decode rows' attention read
    seconds: float
    # Of those, the host's time until the forward pass was enqueued: inputs prepared, kernels
    # launched. Close to `seconds`, the step is host-bound (the device waited for launches).
    # Rank 0's host only under tensor parallelism; on CPU the launch runs the step.
    launch_seconds: float
    # Launched before the previous step's tokens were read (async scheduling): its host work
    # overlapped the previous step's device time.
    launched_ahead: bool = False
    # Of launch_seconds, first launches of kernel variants (Triton compiling them or loading them
    # from its cache): in the middle of serving, a stall that a warm process does not have.
    kernel_first_launch_seconds: float = 0.0

    @property
    def is_prefill(self) -> bool:
        """Whether prompts were prefilled (decode rows may have joined them)."""
        return self.num_prefill_seqs > 0


class StepLog:
    """Appends to `path`; a line per step, written when the step's tokens reach the host."""

    def __init__(self, path: str, engine: dict[str, object]) -> None:
        """engine: fields every line carries, telling apart the engines (a server's sparsity
        pools) that log to one file."""
        self._engine = engine
        # Open as long as the engine (closed by close() or when collected); line-buffered, so a
        # run cut short keeps every step it logged.
        self._file = open(path, "a", buffering=1)  # noqa: SIM115
        self._close = weakref.finalize(self, self._file.close)

    def write(self, record: StepRecord) -> None:
        # Unix time, to line steps up with a client's clock on the same host.
        line = {"end_unix_s": round(time.time(), 6), **self._engine, **asdict(record)}
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._close()

"""`EngineConfig.step_log`: every engine step as one JSON line, a timeline to see where latency
goes (which steps ran, how long each took, how long the host took to launch it, whether it paid
for a kernel's first launch)."""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparse_core.engine.llm_engine import StepRecord


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

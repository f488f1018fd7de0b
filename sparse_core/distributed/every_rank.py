"""The operations of a tensor-parallel engine that every rank runs: rank 0's ModelRunner calls
them, and each worker rank runs the same call when rank 0's command reaches it.

Such an operation issues collectives (a forward pass, a graph capture), so rank 0 running it
alone would wait in the first of them forever. `@every_rank` makes sending it to the other ranks
and running it one call: on rank 0 the method first sends itself to the workers, the workers
run only methods so marked (`run_on_worker`), and a collective issued outside one raises at
once instead of hanging (sparse_core/distributed/communication.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sparse_core.distributed.communication import every_rank_operation


class RankGroup(Protocol):
    """The worker ranks as rank 0 sees them (sparse_core.distributed.driver.TensorParallelWorkers)."""

    def call(self, operation: str, *args: Any) -> None:
        """Every worker runs `operation` (an `@every_rank` method's name) with `args`."""


class OnEveryRank(Protocol):
    """What an `@every_rank` method's object has: rank 0's worker ranks (None on a worker, or
    without tensor parallelism)."""

    workers: RankGroup | None


# Every `@every_rank` method by name: what a worker agrees to run.
OPERATIONS: dict[str, Callable[..., Any]] = {}

Method = TypeVar("Method", bound=Callable[..., Any])


def every_rank(method: Method) -> Method:
    """Mark a method that every rank of a tensor-parallel engine runs, in the same order and with
    the same (positional, picklable) arguments: called on rank 0, it has the workers run it."""
    name = method.__name__
    if name in OPERATIONS:
        raise ValueError(f"two operations every rank runs are named {name!r}")
    OPERATIONS[name] = method

    @functools.wraps(method)
    def run(self: OnEveryRank, *args: Any) -> Any:
        if self.workers is not None:
            self.workers.call(name, *args)
        with every_rank_operation():
            return method(self, *args)

    return run  # type: ignore[return-value]


def run_on_worker(target: object, operation: str, args: tuple[Any, ...]) -> None:
    """A worker rank's side of an operation rank 0 sent (`target`: the worker's runner)."""
    method = OPERATIONS.get(operation)
    if method is None:
        raise ValueError(
            f"{operation!r} is not an operation every rank runs (@every_rank); known: "
            f"{sorted(OPERATIONS)}"
        )
    with every_rank_operation():
        method(target, *args)

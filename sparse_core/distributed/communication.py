"""Collectives over the tensor-parallel group, counted so tests can see what a step issues.

With one rank these return their input untouched; the sharded layers do not even call them.
Counts are of calls made from Python: a replayed CUDA graph issues its captured collectives
without counting them again.

Every rank must issue the same collectives, so they are only allowed inside an operation that
every rank runs (sparse_core/distributed/every_rank.py): one issued anywhere else raises rather
than waiting forever for ranks that never join it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist

from sparse_core.distributed.parallel_state import get_tp_size

COLLECTIVE_CALLS: Counter[str] = Counter()

_operation = threading.local()


@contextlib.contextmanager
def every_rank_operation() -> Iterator[None]:
    """While every rank runs the same operation: collectives may be issued."""
    depth = getattr(_operation, "depth", 0)
    _operation.depth = depth + 1
    try:
        yield
    finally:
        _operation.depth = depth


def _check_every_rank() -> None:
    if not getattr(_operation, "depth", 0):
        raise RuntimeError(
            "a collective outside an operation every rank runs: the other ranks would never "
            "join it; mark the method that issues it @every_rank "
            "(sparse_core/distributed/every_rank.py)"
        )


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place."""
    if get_tp_size() == 1:
        return x
    _check_every_rank()
    COLLECTIVE_CALLS["all_reduce"] += 1
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x, concatenated along dim in rank order."""
    size = get_tp_size()
    if size == 1:
        return x
    _check_every_rank()
    COLLECTIVE_CALLS["all_gather"] += 1
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)

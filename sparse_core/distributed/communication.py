"""Collectives over the tensor-parallel group, counted so tests can see what a step issues.

With one rank these return their input untouched; the sharded layers do not even call them.
Counts are of calls made from Python: a replayed CUDA graph issues its captured collectives
without counting them again.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from sparse_core.distributed.parallel_state import get_tp_size

COLLECTIVE_CALLS: Counter[str] = Counter()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place."""
    if get_tp_size() == 1:
        return x
    COLLECTIVE_CALLS["all_reduce"] += 1
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x, concatenated along dim in rank order."""
    size = get_tp_size()
    if size == 1:
        return x
    COLLECTIVE_CALLS["all_gather"] += 1
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)

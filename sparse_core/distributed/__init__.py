"""Tensor parallelism: attention heads and MLP columns split over ranks (docs/architecture.md).

Each rank holds the KV pools of its own KV heads and scores and selects its own heads, so
compression adds no communication; one scheduler, in the engine's process (rank 0), drives all
ranks.
"""

from sparse_core.distributed.communication import COLLECTIVE_CALLS, all_gather, all_reduce
from sparse_core.distributed.parallel_state import (
    check_tp_divisibility,
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
)

__all__ = [
    "COLLECTIVE_CALLS",
    "all_gather",
    "all_reduce",
    "check_tp_divisibility",
    "destroy_tensor_parallel",
    "get_tp_rank",
    "get_tp_size",
    "init_tensor_parallel",
]

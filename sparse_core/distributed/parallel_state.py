"""This process's place in the tensor-parallel group: rank, size, device, process group."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sparse_core.models.config import ModelConfig

MASTER_ADDR = "127.0.0.1"  # the ranks of one engine share a host: their rendezvous store's address
# Rendezvous and collectives; generous because a worker may still be loading weights.
GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass
class TensorParallelState:
    rank: int = 0
    size: int = 1


_STATE = TensorParallelState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def init_tensor_parallel(
    rank: int, world_size: int, backend: str, store: dist.Store | None = None
) -> None:
    """Join the group (world_size > 1: the default torch.distributed process group)."""
    if world_size > 1:
        if dist.is_initialized() or _STATE.size > 1:
            raise RuntimeError(
                "this process already belongs to a tensor-parallel group; shut the other "
                "tensor-parallel engine down first (LLMEngine.shutdown())"
            )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
        )
    _STATE.rank, _STATE.size = rank, world_size


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.rank, _STATE.size = 0, 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int, world_size: int) -> torch.device:
    """The device a rank runs on: GPU `base + rank` on CUDA (one GPU per rank), else `device`."""
    if world_size == 1 or device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_tp_divisibility(config: ModelConfig, tp_size: int) -> None:
    """Every rank gets whole heads and equal slices of the MLP and vocabulary, or a clear error."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp_size]
    if bad:
        common = math.gcd(*sizes.values())
        valid = [d for d in range(1, min(common, 64) + 1) if common % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide {', '.join(bad)} of model "
            f"{config.name!r}; tensor-parallel sizes that divide all of "
            f"{', '.join(f'{k}={v}' for k, v in sizes.items())}: {valid}"
        )

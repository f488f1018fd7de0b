"""A worker rank's process: its share of the model and KV pools, driven by rank 0's commands."""

from __future__ import annotations

import contextlib
import logging
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.distributed.communication import COLLECTIVE_CALLS
from sparse_core.distributed.every_rank import run_on_worker
from sparse_core.distributed.parallel_state import (
    MASTER_ADDR,
    destroy_tensor_parallel,
    init_tensor_parallel,
    rank_device,
)
from sparse_core.engine.device import resolve_device, set_rank_threads
from sparse_core.engine.model_runner import ModelRunner
from sparse_core.models.config import ModelConfig
from sparse_core.models.loader import ModelSource, load_model_source

logger = logging.getLogger(__name__)


class Worker:
    """What a rank answers to `TensorParallelWorkers.query` (for tests and diagnostics)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def collective_calls(self) -> dict[str, int]:
        return dict(COLLECTIVE_CALLS)

    def reset_collective_calls(self) -> None:
        COLLECTIVE_CALLS.clear()

    def kv_cache_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(attn.k_cache.shape) for attn in self.runner.model.attention_layers]


def worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_port: int,
    config: EngineConfig,
    sparsity: SparsityConfig,
    model_config: ModelConfig,
    weights: dict[str, torch.Tensor] | None,
    pipe: Connection,
) -> None:
    """Join the group, build this rank's runner, then run rank 0's commands until told to stop
    or until rank 0 goes away (the pipe closes)."""
    try:
        device = rank_device(resolve_device(config.device), rank, world_size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        set_rank_threads(device, world_size)
        store = dist.TCPStore(MASTER_ADDR, store_port, world_size, is_master=False)
        init_tensor_parallel(rank, world_size, backend, store)
        if weights is None and not config.model.startswith("dummy:"):
            weights = load_model_source(config.model, config.hf_overrides).weights
        source = ModelSource(model_config, weights, tokenizer=None, path=config.model)
        worker = Worker(ModelRunner(config, sparsity, source))
        del source, weights  # the full weights; the runner keeps its shard
        _reply(pipe, "ready", None)
        while True:
            try:
                method, args = pickle.loads(pipe.recv_bytes())
            except EOFError:
                logger.warning("tensor-parallel rank %d: rank 0 went away; exiting", rank)
                return
            if method == "shutdown":
                return
            if method == "__query__":
                name, query_args = args
                _reply(pipe, "ok", getattr(worker, name)(*query_args))
            else:
                run_on_worker(worker.runner, method, args)
    except Exception:
        # Rank 0 sees this on its next read of the pipe, or as a failed collective.
        _reply(pipe, "error", traceback.format_exc())
    finally:
        destroy_tensor_parallel()
        pipe.close()


def _reply(pipe: Connection, kind: str, value: Any) -> None:
    with contextlib.suppress(OSError):  # rank 0 is gone
        pipe.send_bytes(pickle.dumps((kind, value)))

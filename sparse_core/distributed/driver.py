"""Rank 0's side of tensor parallelism: start the worker ranks, send them work, stop them.

Worker r (1 <= r < tp) is a process of its own (spawned, so CUDA works in it), joined to rank 0
by a pipe for commands and by the torch.distributed group for the collectives of the forward.
A command is an operation every rank runs (a ModelRunner method marked `@every_rank`,
sparse_core/distributed/every_rank.py) and its arguments, pickled once and written to every
pipe; a worker runs the same operation on its own runner. Commands carry host data only (token ids,
slots, block tables), so the pipe costs microseconds per step next to the forward.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.distributed.parallel_state import (
    MASTER_ADDR,
    backend_for,
    destroy_tensor_parallel,
    get_tp_size,
    init_tensor_parallel,
    rank_device,
)
from sparse_core.distributed.worker import worker_main
from sparse_core.engine.device import resolve_device
from sparse_core.models.loader import ModelSource

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


class WorkerError(RuntimeError):
    """A worker rank failed or exited."""


class TensorParallelWorkers:
    """The worker ranks 1..tp-1 of an engine whose process is rank 0."""

    def __init__(self, config: EngineConfig, sparsity: SparsityConfig, source: ModelSource) -> None:
        """Spawn the workers and join the process group as rank 0. The workers then build their
        share of the model while rank 0 builds its own; `call` waits until they are ready.

        On CPU the workers map rank 0's loaded weights (shared memory) instead of loading and
        dequantising the files again; on GPUs each worker reads the files itself, which needs no
        host shared memory the size of the checkpoint."""
        if dist.is_initialized() or get_tp_size() > 1:
            raise RuntimeError(
                "this process already drives a tensor-parallel engine (one per process); "
                "shut it down first with LLMEngine.shutdown()"
            )
        world_size = config.tensor_parallel_size
        device = resolve_device(config.device)
        backend = backend_for(device)
        if device.type == "cuda":
            first, visible = device.index or 0, torch.cuda.device_count()
            if first + world_size > visible:
                raise ValueError(
                    f"tensor_parallel_size={world_size} from GPU {first} needs GPUs "
                    f"{first}..{first + world_size - 1}; {visible} visible"
                )
            torch.cuda.set_device(rank_device(device, 0, world_size))  # rank 0's GPU for NCCL
        shared_weights = source.weights if device.type == "cpu" else None
        # Rank 0 hosts the rendezvous store on a free port, so there is no port to race for.
        store = dist.TCPStore(MASTER_ADDR, 0, world_size, is_master=True, wait_for_workers=False)
        context = torch.multiprocessing.get_context("spawn")
        self.processes: list[mp.process.BaseProcess] = []
        self.pipes: list[Connection] = []
        self._ready = False
        self._closed = False
        for rank in range(1, world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(
                    rank,
                    world_size,
                    backend,
                    store.port,
                    config,
                    sparsity,
                    source.config,
                    shared_weights,
                    child,
                ),
                name=f"kvsparse-tp{rank}",
                daemon=True,  # never outlives the engine's process
            )
            process.start()
            child.close()
            self.processes.append(process)
            self.pipes.append(parent)
        try:
            init_tensor_parallel(0, world_size, backend, store)
        except BaseException:
            self.shutdown()
            raise
        self._store = store  # kept alive: the workers' store clients talk to it

    def call(self, operation: str, *args: Any) -> None:
        """Every worker runs the operation (an `@every_rank` method of its runner) with `args`;
        returns once the command is sent. ModelRunner's marked methods call this themselves."""
        if self._closed:
            raise WorkerError("the tensor-parallel workers are shut down")
        if not self._ready:
            self._wait_ready()
        payload = pickle.dumps((operation, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(payload)
            except OSError as exc:
                raise WorkerError(f"tensor-parallel worker rank {rank} is gone") from exc

    def query(self, method: str, *args: Any) -> list[Any]:
        """Every worker runs `method` of its worker object and replies (tests, diagnostics)."""
        self.call("__query__", method, args)
        return [self._receive(rank, pipe) for rank, pipe in enumerate(self.pipes, start=1)]

    def _wait_ready(self) -> None:
        for rank, pipe in enumerate(self.pipes, start=1):
            self._receive(rank, pipe)
        self._ready = True

    def _receive(self, rank: int, pipe: Connection) -> Any:
        process = self.processes[rank - 1]
        while not pipe.poll(1.0):
            if not process.is_alive():
                raise WorkerError(
                    f"tensor-parallel worker rank {rank} exited with code {process.exitcode}"
                )
        try:
            kind, value = pickle.loads(pipe.recv_bytes())
        except EOFError as exc:
            raise WorkerError(f"tensor-parallel worker rank {rank} closed its pipe") from exc
        if kind == "error":
            raise WorkerError(f"tensor-parallel worker rank {rank} failed:\n{value}")
        return value

    def shutdown(self) -> None:
        """Stop every worker (a polite command, then terminate) and leave the process group.
        Safe to call more than once, and at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        payload = pickle.dumps(("shutdown", ()))
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # already gone
                pipe.send_bytes(payload)
        for process in self.processes:
            process.join(SHUTDOWN_TIMEOUT_S)
            if process.is_alive():
                logger.warning("tensor-parallel worker %s did not stop; terminating", process.name)
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        destroy_tensor_parallel()

"""`AsyncLLM`: the engine stepping in the background, with asyncio streams per request.

The engine runs in a process of its own on a GPU (see `engine_core`), on a thread of this
process on CPU. Either way all engine state is touched only by its loop: requests and aborts
reach it as commands, and each step's outputs come back to the caller's event loop in one
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncGenerator
from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.engine_core import ProcessEngineCore, StepResult, ThreadEngineCore
from sparse_core.engine.llm_engine import EngineStats, LLMEngine
from sparse_core.engine.model_runner import resolve_device
from sparse_core.engine.outputs import RequestOutput
from sparse_core.engine.sampling_params import SamplingParams
from sparse_core.engine.sequence import Sequence

# With the engine on a thread of this process, it shares the GIL with the event loop that
# streams responses. Python hands the GIL to a waiting thread only every switch interval (5 ms by
# default, as long as half a decode step): the engine thread, back from the GPU, would leave the
# GPU idle that long while the loop formats responses.
ENGINE_SWITCH_INTERVAL_S = 0.0005


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, sparsity: SparsityConfig, engine_process: bool | None = None
    ) -> None:
        """engine_process: run the engine in a process of its own; default: on CUDA devices."""
        if engine_process is None:
            engine_process = resolve_device(config.device).type == "cuda"
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Ids given to the engine whose last output (finished, aborted or failed) has not come
        # back yet: an id is not reused before, or the engine's outputs of the old request would
        # reach the new one.
        self._in_flight: set[str] = set()
        self._ids = itertools.count()
        self._core: ThreadEngineCore | ProcessEngineCore
        if engine_process:
            self._core = ProcessEngineCore(config, sparsity, self._on_step)
        else:
            sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
            self._core = ThreadEngineCore(LLMEngine(config, sparsity), self._on_step)
        self.checker = self._core.checker
        self._stats = self._core.initial_stats

    @property
    def tokenizer(self):
        return self.checker.tokenizer

    def stats(self) -> EngineStats:
        """Counts as of the last step (read without touching the engine loop's state)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        """The engine loop is alive (a health check)."""
        return self._core.is_alive()

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate the request now, then return its stream: the output after every step until
        it finishes.

        A bad request raises ValueError here, before anything is queued; the request is queued
        when the stream is first iterated. If the consumer stops iterating (a client
        disconnected), the request is aborted and its blocks freed.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        self._check_unused(request_id)
        return self._stream(self.checker.make_sequence(request_id, prompt, params))

    def _check_unused(self, request_id: str) -> None:
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in use")

    async def _stream(self, seq: Sequence) -> AsyncGenerator[RequestOutput, None]:
        request_id = seq.request_id
        self._check_unused(request_id)  # again: two streams of one id may both be unstarted
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._in_flight.add(request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            self._core.send(("add", seq))
            while True:
                item = await stream.get()
                # Outputs are cumulative: a consumer that fell behind gets only the newest.
                while not isinstance(item, BaseException) and not stream.empty():
                    item = stream.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._core.send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._core.send(("abort", request_id))

    def shutdown(self) -> None:
        self._core.shutdown()

    def _on_step(self, result: StepResult) -> None:
        """From the engine loop's thread: keep the counts, and hand every output (or error) to
        its stream, with one wake-up per event loop for the whole step."""
        self._stats = result.stats
        items: list[tuple[str, RequestOutput | BaseException]] = [
            (out.request_id, out) for out in result.outputs
        ]
        items += [(request_id, RuntimeError(message)) for request_id, message in result.errors]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, stream = target
                by_loop.setdefault(loop, []).append((stream, item))
            if not isinstance(item, RequestOutput) or item.finished:
                self._in_flight.discard(request_id)  # only now may the id be used again
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_deliver, deliveries)


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream, item in deliveries:
        stream.put_nowait(item)

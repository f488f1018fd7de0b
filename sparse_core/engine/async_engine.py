"""`AsyncLLM`: the engine stepping in the background, with asyncio streams per request.

The engine runs in a process of its own on a GPU (see `engine_core`), on a thread of this
process on CPU. Either way all engine state is touched only by its loop: requests and aborts
reach it as commands, and each step's outputs come back to the caller's event loop in one
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import sys
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.device import resolve_device
from sparse_core.engine.engine_core import ProcessEngineCore, StepResult, ThreadEngineCore
from sparse_core.engine.llm_engine import EngineStats, LLMEngine
from sparse_core.outputs import RequestOutput
from sparse_core.sampling_params import SamplingParams

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
    ) -> RequestStream:
        """Validate the request and queue it now; return its stream: the output after every
        step until it finishes. Call it from a coroutine (the stream belongs to its event loop).

        A bad request raises ValueError here, before anything is queued. Queued at once, a
        request of a burst does not wait for the server to parse the ones that came with it.
        Closing the stream before its last output (a client that disconnected), or dropping it,
        read from or not, aborts the request and frees its blocks.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.checker.make_sequence(request_id, prompt, params)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._in_flight.add(request_id)
        self._core.send(("add", seq))
        abandon = functools.partial(self._release, request_id, queue, True)
        return RequestStream(self._stream(request_id, queue), abandon)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                item = await queue.get()
                # Outputs are cumulative: a consumer that fell behind gets only the newest.
                while not isinstance(item, BaseException) and not queue.empty():
                    item = queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._release(request_id, queue, not finished)

    def _release(self, request_id: str, queue: asyncio.Queue, abort: bool) -> None:
        """A stream is done with: stop delivering to it and, if its request has not finished,
        abort it. Only while `queue` is still the id's stream: once a request has finished, a
        new one may take its id (from any thread: dict operations and command queues)."""
        target = self._streams.get(request_id)
        if target is None or target[1] is not queue:
            return
        del self._streams[request_id]
        if abort:
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


class RequestStream:
    """A queued request's outputs (`AsyncLLM.generate`): an async iterator of RequestOutput.

    Closed (`aclose`) or dropped before its last output, read from or not, it aborts its
    request: the generator behind it would run no cleanup if it never started."""

    def __init__(
        self, outputs: AsyncGenerator[RequestOutput, None], abandon: Callable[[], None]
    ) -> None:
        self._outputs = outputs
        # `abandon` does nothing once the request has finished: call it whenever the stream ends.
        self._abandon = weakref.finalize(self, abandon)
        self._abandon.atexit = False

    def __aiter__(self) -> RequestStream:
        return self

    def __anext__(self) -> Awaitable[RequestOutput]:
        return self._outputs.__anext__()

    async def aclose(self) -> None:
        self._abandon()
        await self._outputs.aclose()


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream, item in deliveries:
        stream.put_nowait(item)

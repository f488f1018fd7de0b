"""`AsyncLLM`: the engine stepping on a background thread, with asyncio streams per request.

All engine state is touched only by the engine thread: requests and aborts reach it through a
queue, and each step's outputs go back to the caller's event loop in one `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
from collections.abc import AsyncGenerator
from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.llm_engine import EngineStats, LLMEngine
from sparse_core.engine.outputs import RequestOutput
from sparse_core.engine.sampling_params import SamplingParams
from sparse_core.engine.sequence import Sequence

# The engine thread shares the GIL with the event loop that streams responses. Python hands the
# GIL to a waiting thread only every switch interval (5 ms by default, as long as half a decode
# step): the engine thread, back from the GPU, would leave the GPU idle that long while the loop
# formats responses.
ENGINE_SWITCH_INTERVAL_S = 0.0005


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._stopped = threading.Event()
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._loop, name="kvsparse-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, sparsity: SparsityConfig) -> AsyncLLM:
        return cls(LLMEngine(config, sparsity))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """Counts as of the last step (read without touching the engine thread's state)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        """The engine thread is alive (a health check)."""
        return self._thread.is_alive()

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
        return self._stream(self.engine.make_sequence(request_id, prompt, params))

    async def _stream(self, seq: Sequence) -> AsyncGenerator[RequestOutput, None]:
        request_id = seq.request_id
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", seq))
        finished = False
        try:
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
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            # Block for work when idle; otherwise drain commands without waiting.
            self._handle(self._commands.get() if not engine.has_unfinished else None)
            while True:
                try:
                    self._handle(self._commands.get_nowait())
                except queue.Empty:
                    break
            if not engine.has_unfinished:
                self._stats = engine.stats()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                for request_id in list(engine.sequences):
                    engine.abort(request_id)
                    self._publish_error(request_id, exc)
                outputs = []
            self._stats = engine.stats()
            self._publish_all([(out.request_id, out) for out in outputs])

    def _handle(self, command: tuple[str, Any] | None) -> None:
        if command is None:
            return
        kind, arg = command
        if kind == "add":
            seq: Sequence = arg
            if seq.request_id in self._streams:
                self.engine.add_sequence(seq)
        elif kind == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._publish(arg, out)

    def _publish(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._publish_all([(request_id, item)])

    def _publish_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """One wake-up per event loop for a whole step's outputs, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, stream = target
                by_loop.setdefault(loop, []).append((stream, item))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_deliver, deliveries)

    def _publish_error(self, request_id: str, exc: BaseException) -> None:
        self._publish(request_id, RuntimeError(f"engine step failed: {exc}"))


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream, item in deliveries:
        stream.put_nowait(item)

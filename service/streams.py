"""Starting the sub-requests of one HTTP request (prompts x n) and interleaving their chunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from service.messages import Chunk, GenerateRequest


class Backend(Protocol):
    """Where requests run: engines in this process, or Ray Serve engine replicas."""

    def stream(self, pool: str, request: GenerateRequest) -> AsyncIterator[Chunk]: ...

    async def check_health(self) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def open_streams(
    backend: Backend, pool: str, requests: list[GenerateRequest]
) -> list[AsyncIterator[Chunk]]:
    """Start every sub-request and wait until each is accepted (its first, empty chunk), so that
    a bad request fails with its 4xx before any response is sent; on failure all are closed."""
    streams: list[AsyncIterator[Chunk]] = []
    try:
        for request in requests:
            stream = backend.stream(pool, request)
            streams.append(stream)
            await anext(stream)
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def every_n_tokens(chunks: AsyncIterator[Chunk], n: int) -> AsyncIterator[Chunk]:
    """`chunks` merged so that each carries at least `n` new tokens (vLLM's `stream_interval`),
    except the first two (accepted, first token) and the last, which pass at once: time to first
    token is unchanged, and a stream crossing a process boundary sends n times fewer messages."""
    pending: Chunk | None = None
    sent_tokens = 0
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            pending = chunk if pending is None else pending.then(chunk)
            if (
                pending.num_tokens <= 1
                or pending.finish_reason is not None
                or pending.num_tokens - sent_tokens >= n
            ):
                yield pending
                sent_tokens, pending = pending.num_tokens, None


async def close_all(streams: list[AsyncIterator[Chunk]]) -> None:
    """Closing a stream aborts its request in the engine and frees its KV blocks."""
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]


async def merge(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(stream index, chunk) as chunks arrive from any stream, until all are done."""
    if len(streams) == 1:  # the common case, without tasks
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        # Cancelling a pump closes its stream (and aborts its request) without awaiting here:
        # this may run inside a cancelled scope, where any await is interrupted again.
        for task in tasks:
            task.cancel()

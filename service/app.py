"""The OpenAI-compatible ASGI app, the same for the standalone server and the Ray Serve ingress.

Only the backend differs: engines in this process (`service.standalone.LocalBackend`) or Ray Serve
engine replicas (`service.ray_app.RayBackend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from service.drain import Drain, shutting_down
from service.errors import APIError, invalid_value, overloaded
from service.messages import GenerateRequest
from service.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, parse
from service.responses import ChatFormat, Choice, CompletionFormat
from service.settings import BODY_BYTES_OUTSIDE_BUDGET, ServerSettings
from service.streams import Backend, close_all, merge, open_streams

logger = logging.getLogger(__name__)


class Admission:
    """A bound on sub-requests in flight, so that overload is answered, not buffered."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0

    def acquire(self, count: int) -> None:
        if self.inflight + count > self.limit:
            raise overloaded(
                f"the server has {self.inflight} requests in flight (limit {self.limit}); "
                "retry later"
            )
        self.inflight += count

    def release(self, count: int) -> None:
        self.inflight -= count


class BodyBudget:
    """Bytes that request bodies still being received hold together, beyond each one's first
    `BODY_BYTES_OUTSIDE_BUDGET`: past `limit`, the request that asks for more gets 503."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[Callable[[int], None]]:
        """`hold(n)`: the body read so far has n bytes (raises APIError 503 past the budget);
        released when the block ends."""
        mine = 0

        def hold(num_bytes: int) -> None:
            nonlocal mine
            wanted = max(num_bytes - BODY_BYTES_OUTSIDE_BUDGET, 0)
            if self.held - mine + wanted > self.limit:
                raise overloaded(
                    f"request bodies being received hold {self.held} bytes (limit "
                    f"{self.limit}); retry later",
                    status=503,
                )
            self.held += wanted - mine
            mine = wanted

        try:
            yield hold
        finally:
            self.held -= mine


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator however the response ends, so that a client that goes away
    aborts its requests at once instead of when the generator is garbage-collected. Cut by a
    shutdown (its task cancelled through `drain`), it ends with an error event and `[DONE]`."""

    def __init__(self, content: AsyncIterator[str], drain: Drain) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.drain = drain

    async def stream_response(self, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            with self.drain.cuttable(task.cancel):
                await super().stream_response(send)
        except asyncio.CancelledError:
            if not self.drain.cutting:
                raise
            task.uncancel()
            end = _sse(shutting_down().body()) + "data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": end.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(
    backend: Backend, settings: ServerSettings, metrics_registry: Any | None = None
) -> FastAPI:
    """The app; `metrics_registry` (prometheus_client) adds `/metrics` (standalone mode)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(
        title="kvsparse", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    admission = Admission(settings.max_inflight_requests)
    drain = app.state.drain = Drain()
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        response = exc.response()
        if exc.status == 408:  # the rest of the body may still come: the connection is unusable
            response.headers["connection"] = "close"
        return response

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")  # fmt: skip
        if not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    body_budget = BodyBudget(settings.max_buffered_body_bytes)

    async def read_body(request: Request) -> bytes:
        """The body of a JSON request, within `max_request_bytes` and the time and memory
        limits (415, 413, 408, 503)."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            # A browser sends a cross-origin form or text/plain POST without asking first: only
            # a JSON content type, which it must ask for, reaches the engines.
            raise APIError(415, f"Content-Type must be application/json, got "
                           f"{media_type or 'none'!r}", code="unsupported_media_type")  # fmt: skip
        limit = settings.max_request_bytes
        too_large = APIError(413, f"request body is larger than {limit} bytes",
                             code="request_too_large")  # fmt: skip
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = bytearray()
        timeout = settings.timeout_request_body_s
        try:
            with body_budget.holding() as hold:
                async with asyncio.timeout(timeout):
                    async for part in request.stream():
                        body += part
                        if len(body) > limit:
                            raise too_large
                        hold(len(body))
        except TimeoutError:
            raise APIError(408, f"request body not received within {timeout} s",
                           code="request_timeout") from None  # fmt: skip
        except ClientDisconnect:
            logger.debug("client %s went away while sending its body", request.client)
            raise APIError(499, "client closed the request", code="client_closed_request") from None
        return bytes(body)

    async def generate(
        request: Request,
        req: SamplingFields,
        prompts: list[dict[str, Any]],
        max_tokens: int | None,
        fmt: CompletionFormat,
    ) -> Response:
        if req.model not in settings.served_model_names:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                           f"{' or '.join(map(repr, settings.served_model_names))}", param="model",
                           code="model_not_found")  # fmt: skip
        pool = settings.select_pool(req.kvsparse)
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        if len(prompts) * req.n > settings.max_choices:
            raise APIError(400, f"prompts x n must be at most {settings.max_choices}",
                           param="n", code="invalid_value")  # fmt: skip
        try:  # the n choices' settings (each its own seed)
            params = [req.sampling_params(max_tokens, j) for j in range(req.n)]
        except ValueError as exc:
            raise invalid_value(exc, None) from None
        choices: list[Choice] = []
        requests: list[GenerateRequest] = []
        for p, prompt in enumerate(prompts):
            for j in range(req.n):
                choices.append(Choice(index=len(choices), prompt_index=p))
                request_id = f"{fmt.id}-{len(requests)}"
                requests.append(
                    GenerateRequest(request_id, params=params[j],
                                    return_token_ids=req.return_token_ids, **prompt)
                )  # fmt: skip
        admission.acquire(len(requests))
        try:
            streams = await open_streams(backend, pool.name, requests)
        except BaseException:
            admission.release(len(requests))
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def take(index: int, chunk: Any) -> Choice:
            choice = choices[index]
            choice.text += chunk.text
            choice.completion_tokens = chunk.num_tokens
            choice.prompt_tokens = chunk.prompt_tokens
            choice.cached_tokens = chunk.cached_tokens
            choice.token_ids += chunk.token_ids
            choice.logprobs += chunk.logprobs
            if chunk.prompt_token_ids is not None:
                choice.prompt_token_ids = chunk.prompt_token_ids
            if chunk.finish_reason is not None:
                choice.finish_reason = chunk.finish_reason
                choice.compression_ratio = chunk.compression_ratio
            return choice

        async def events() -> AsyncIterator[str]:
            try:
                for obj in fmt.opening(choices):
                    yield _sse(obj)
                async with contextlib.aclosing(merge(streams)) as chunks:
                    async for index, chunk in chunks:
                        choice = take(index, chunk)
                        yield _sse(fmt.chunk(choice, chunk))
                if include_usage:
                    yield _sse(fmt.usage_chunk(choices))
                yield "data: [DONE]\n\n"
            except APIError as exc:  # after the 200 went out: the error is the last event
                yield _sse(exc.body())
                yield "data: [DONE]\n\n"
            except Exception as exc:  # not expected; the client still learns the stream failed
                logger.exception("stream %s failed", fmt.id)
                yield _sse(APIError(500, f"stream failed: {type(exc).__name__}",
                                    code="engine_error").body())  # fmt: skip
                yield "data: [DONE]\n\n"
            finally:
                admission.release(len(requests))
                await close_all(streams)

        if req.stream:
            return _ClosingStreamingResponse(events(), drain)

        async def collect() -> None:
            async with contextlib.aclosing(merge(streams)) as chunks:
                async for index, chunk in chunks:
                    take(index, chunk)

        try:
            await _unless_disconnected(request, collect(), drain)
        finally:
            admission.release(len(requests))
            await close_all(streams)
        return JSONResponse(fmt.response(choices, pool.name))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = parse(CompletionRequest, await read_body(request))
        prompts = [{"prompt": p} for p in req.prompts()]
        fmt = CompletionFormat(req.model, req.return_token_ids, req.num_logprobs is not None)
        return await generate(request, req, prompts, req.max_tokens, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = parse(ChatCompletionRequest, await read_body(request))
        prompts = [{"messages": req.template_messages()}]
        fmt = ChatFormat(req.model, req.return_token_ids, req.num_logprobs is not None)
        return await generate(request, req, prompts, req.max_new_tokens, fmt)

    cards = {
        name: {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "kvsparse",
            "max_model_len": settings.max_model_len,
            "kvsparse": {
                "pools": [p.describe() for p in settings.pools],
                "quantization": settings.quantization,
                "checkpoint_quantization": settings.checkpoint_quantization,
                "kv_cache_dtype": settings.kv_cache_dtype,
            },
        }
        for name in settings.served_model_names
    }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        authorize(request)
        if model_id not in cards:
            raise APIError(404, f"The model {model_id!r} does not exist", param="model",
                           code="model_not_found")  # fmt: skip
        return cards[model_id]

    @app.get("/health")
    async def health() -> dict[str, str]:
        await backend.check_health()
        return {"status": "ok"}

    if metrics_registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _unless_disconnected(request: Request, work: Any, drain: Drain) -> None:
    """Run `work`; if the client goes away first, or a shutdown cuts it, cancel it (which
    aborts its requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        with drain.cuttable(task.cancel):
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        if drain.cutting:
            raise shutting_down()
        raise APIError(499, "client closed the request", code="client_closed_request")
    task.result()

"""uvicorn as a production server runs it: every phase of a request bounded in time and size, a
graceful shutdown with a bound, a second signal that exits at once, and an access log without
query strings (where API keys and other secrets travel).

- Before the app sees a request, `ConnectionLimits` bound what a client can hold: connections,
  the bytes and fields of a request's head, and the time its headers take. uvicorn closes idle
  kept-alive connections after `timeout_keep_alive`; the app bounds reading the body (its size,
  time, and the bytes all bodies being read hold together: `ServerSettings`).
- When an engine dies, the server exits (status 1), as vLLM's does, for its supervisor to
  restart it; `/health` answers 503 meanwhile, and requests in flight end with an error.
- On SIGTERM or SIGINT, uvicorn stops accepting and waits for the requests in flight; at
  `timeout_graceful_shutdown` minus `CUT_MARGIN_S` the responses still running are cut
  (`service.drain`), and at `timeout_graceful_shutdown` whatever is left is cancelled. A second
  signal exits at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.drain import Drain
from service.errors import APIError

logger = logging.getLogger(__name__)

# Time between cutting the responses still running and cancelling what is left.
CUT_MARGIN_S = 1.0
# How long a connection refused by ConnectionLimits stays open to drain what the client still
# sends, so that it reads the answer.
LINGER_S = 1.0
FORCED_EXIT_STATUS = 1
FAILED_EXIT_STATUS = 1  # an engine died


@dataclass(frozen=True)
class ConnectionLimits:
    """What a client can make the server hold before the app sees a request. uvicorn bounds none
    of it with httptools (its h11 parser bounds the head, but answers 400), and its
    `limit_concurrency` answers 503 in plain text after reading a request; these are answered in
    the API's error format, with Retry-After where a retry may succeed, and the connection
    closes."""

    # Headers complete within this of the connection, or of a kept-alive request's first byte
    # (else 408): an idle or trickling connection holds nothing for long.
    timeout_request_header: float = 10.0
    # The request line and headers together (else 431), and the number of header fields.
    limit_request_header_bytes: int = 64 * 2**10
    limit_request_fields: int = 100
    # Open connections; one more is answered 503 as it opens (None: no bound).
    limit_connections: int | None = 1024


class ServerConfig(uvicorn.Config):
    """uvicorn's configuration, with `limits` on what a connection may hold."""

    def __init__(self, app: Any, limits: ConnectionLimits | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("log_config", access_log_without_queries())
        super().__init__(app, http=BoundedHttpToolsProtocol, **kwargs)
        self.limits = limits or ConnectionLimits()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol within `ConnectionLimits`: a connection beyond the limit, a
    head too large or with too many fields, or headers that do not arrive in time are answered
    with an error and the connection closes."""

    def __init__(self, config: ServerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._limits = config.limits
        self._header_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # received since the current head began
        self._num_fields = 0
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self._limits.limit_connections
        if limit is not None and len(self.connections) > limit:
            self._refuse(APIError(503, f"the server has {limit} connections open (its limit); "
                                  "retry later", code="server_overloaded", retry_after=1))  # fmt: skip
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._header_timer is not None:  # still within a head: all of it counts
            self._head_bytes += len(data)
            if self._head_bytes > self._limits.limit_request_header_bytes:
                self._refuse_head(f"request line and headers exceed "
                                  f"{self._limits.limit_request_header_bytes} bytes")  # fmt: skip

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._num_fields = 0
        self._arm_header_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._num_fields += 1
        if self._num_fields > self._limits.limit_request_fields:
            self._refuse_head(f"more than {self._limits.limit_request_fields} header fields")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self._refused:
            timeout = self._limits.timeout_request_header
            self._header_timer = self.loop.call_later(timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        timeout = self._limits.timeout_request_header
        self._refuse(APIError(408, f"request headers not received within {timeout} s",
                              code="request_timeout"))  # fmt: skip

    def _refuse_head(self, why: str) -> None:
        self._refuse(APIError(431, f"request header fields too large: {why}",
                              code="request_header_fields_too_large"))  # fmt: skip

    def _refuse(self, error: APIError) -> None:
        """Answer `error` and close, whatever the connection was doing (no app runs for it)."""
        self._refused = True
        self._disarm_header_timer()
        if self.transport.is_closing():
            return
        response = error.response()
        head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
                "content-type: application/json", f"content-length: {len(response.body)}",
                "connection: close"]  # fmt: skip
        head += [f"{k}: {v}" for k, v in response.headers.items() if k == "retry-after"]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + response.body)
        # A lingering close, as nginx's: closing with the client's bytes unread would reset the
        # connection, and a reset can discard the answer before the client reads it. What still
        # arrives is dropped unread (`data_received`) until the client closes or LINGER_S pass.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn.Server that cuts the responses in `drain` before its graceful shutdown ends, and
    exits at once on a second signal. `failure()`, checked every tick (0.1 s), says why the
    server can no longer serve (an engine died): it then shuts down, `exit_status` 1, for its
    supervisor to start it again."""

    def __init__(
        self, config: ServerConfig, drain: Drain, failure: Callable[[], str | None] = lambda: None
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.failure = failure
        self.exit_status = 0

    async def on_tick(self, counter: int) -> bool:
        reason = self.failure()
        if reason is not None and not self.should_exit:
            logger.error("engine stopped (%s): shutting down for the supervisor to restart", reason)
            self.exit_status = FAILED_EXIT_STATUS
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            logger.warning("second signal %d during shutdown: exiting now", sig)
            os._exit(FORCED_EXIT_STATUS)  # the engine process exits when its pipe closes
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        cut = None
        if timeout is not None:
            delay = max(timeout - CUT_MARGIN_S, 0.0)
            cut = asyncio.get_running_loop().call_later(delay, self.drain.cut_all)
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()


class PathOnly(logging.Filter):
    """Access-log records with the request's path but not its query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (*args[:2], args[2].partition("?")[0], *args[3:])
        return True


def access_log_without_queries() -> dict[str, Any]:
    """uvicorn's logging configuration, its access log through `PathOnly`."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"path_only": {"()": PathOnly}}
    config["handlers"]["access"]["filters"] = ["path_only"]
    return config

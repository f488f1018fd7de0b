"""uvicorn as a production server runs it: every phase of a request bounded in time, a graceful
shutdown with a bound, a second signal that exits at once, and an access log without query
strings (where API keys and other secrets travel).

- Request headers must arrive within `timeout_request_header` of the connection (or of the
  request's first byte on a kept-alive connection), else 408 and the connection is closed: an
  idle or trickling connection holds nothing for long. uvicorn closes idle kept-alive
  connections after `timeout_keep_alive`; the app bounds reading the body
  (`ServerSettings.timeout_request_body_s`).
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
FORCED_EXIT_STATUS = 1
FAILED_EXIT_STATUS = 1  # an engine died


class ServerConfig(uvicorn.Config):
    """uvicorn's configuration, with a bound on receiving a request's headers."""

    def __init__(self, app: Any, timeout_request_header: float = 10.0, **kwargs: Any) -> None:
        kwargs.setdefault("log_config", access_log_without_queries())
        super().__init__(app, http=TimedHttpToolsProtocol, **kwargs)
        self.timeout_request_header = timeout_request_header


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose headers do not arrive in time."""

    def __init__(self, config: ServerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._header_timeout = config.timeout_request_header
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self._header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        error = APIError(408, f"request headers not received within {self._header_timeout} s",
                         code="request_timeout")  # fmt: skip
        body = error.response().body
        head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
        self.transport.write(head.encode() + body)
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

"""`kvsparse serve` under slow and idle clients and SIGTERM: every phase of a request is bounded,
shutdown ends within its bound whatever the clients do, streams cut by it end with an error
event and [DONE], a second signal exits at once, and nothing secret reaches the log."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from service.http_server import FORCED_EXIT_STATUS
from tests.service.servers import ServeProcess

HEADER_S, BODY_S, GRACE_S = 1, 4, 2
# Random weights of a tiny shape: quick to load; a stream of 8000 tokens runs for seconds.
TINY = ["dummy:tiny", "--policy", "dense", "--max-model-len", "8192", "--kv-cache-memory-gb",
        "0.05", "--served-model-name", "tiny", "--log-level", "info"]  # fmt: skip
LONG_STREAM = {"model": "tiny", "prompt": "Go", "max_tokens": 8000, "ignore_eos": True,
               "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    """On every interface, without an API key; short timeouts. The last test shuts it down."""
    process = ServeProcess([*TINY, "--host", "0.0.0.0", "--timeout-request-header", str(HEADER_S),
                            "--timeout-request-body", str(BODY_S),
                            "--timeout-graceful-shutdown", str(GRACE_S)])  # fmt: skip
    try:
        yield process.wait_healthy()
    finally:
        process.stop()


def connect(server: ServeProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.settimeout(30)
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_serving_without_a_key_on_every_interface_warns(server):
    assert "without an API key" in server.output()


def test_query_strings_stay_out_of_the_access_log(server):
    assert httpx.get(server.base_url + "/v1/models?api_key=sekrit-4711").status_code == 200
    time.sleep(0.5)
    log = server.output()
    assert "GET /v1/models HTTP/1.1" in log
    assert "sekrit-4711" not in log


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_idle_or_trickling_headers_get_408_and_the_connection_closed(server, sent):
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        answer = read_all(sock)  # until the server closes the connection
        assert time.monotonic() - start < HEADER_S + 1.5
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_body_not_received_in_time_gets_408(server):
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")  # fmt: skip
        answer = read_all(sock)
        assert time.monotonic() - start < BODY_S + 1.5
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"request_timeout"' in answer


def trickle(server: ServeProcess, stop: threading.Event) -> None:
    """A body at 1 byte per second, until told to stop or the server goes away."""
    try:
        with connect(server) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                b"Content-Type: application/json\r\n\r\n"
            )
            while not stop.wait(1.0):
                sock.sendall(b" ")
    except OSError:
        pass


def test_sigterm_ends_within_its_bound_and_cuts_streams_with_an_error_event(server):
    """Last in this module: it shuts the server down."""
    stop = threading.Event()
    trickler = threading.Thread(target=trickle, args=(server, stop), daemon=True)
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=LONG_STREAM,
                          timeout=60) as response:  # fmt: skip
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            trickler.start()
            time.sleep(0.5)
            start = time.monotonic()
            server.signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        server.process.wait(timeout=GRACE_S + 10)
        assert time.monotonic() - start < GRACE_S + 3, server.output()
    finally:
        stop.set()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "server_shutting_down")


def test_a_second_signal_exits_at_once():
    server = ServeProcess([*TINY, "--host", "127.0.0.1", "--timeout-graceful-shutdown", "60"])
    try:
        server.wait_healthy()
        with httpx.stream("POST", server.base_url + "/v1/completions", json=LONG_STREAM,
                          timeout=60) as response:  # fmt: skip
            lines = response.iter_lines()  # kept: dropping it closes the connection
            assert next(lines).startswith("data: ")
            server.signal(signal.SIGTERM)
            time.sleep(1.0)
            assert server.process.poll() is None  # draining the stream
            start = time.monotonic()
            server.signal(signal.SIGTERM)
            assert server.process.wait(timeout=10) == FORCED_EXIT_STATUS
            assert time.monotonic() - start < 2
        assert "without an API key" not in server.output()  # loopback only
    finally:
        server.stop()

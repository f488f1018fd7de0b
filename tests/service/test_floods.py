"""Floods against `kvsparse serve` as a process: request heads without end, hundreds of
half-sent bodies, connections past the limit, clients that go away mid-body. The server's memory
stays within 200 MB of idle and comes back near it, a normal request succeeds meanwhile, and the
log stays quiet."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.service.servers import ServeProcess

KEY = "flood-key"
LIMIT_CONNECTIONS = 600
SERVER = ["dummy:tiny", "--policy", "dense", "--max-model-len", "512", "--kv-cache-memory-gb",
          "0.05", "--served-model-name", "tiny", "--host", "127.0.0.1", "--api-key", KEY,
          "--limit-connections", str(LIMIT_CONNECTIONS)]  # fmt: skip
MB = 2**20
FLOOD_HEADROOM = 200 * MB  # over idle, at the flood's peak
AFTER_HEADROOM = 50 * MB  # over idle, once the flood has gone
BODY = 4 * MB - 1  # just under --max-request-bytes


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    process = ServeProcess(SERVER)
    try:
        process.wait_healthy()
        assert normal_request(process)  # everything a request touches loaded
        yield process
    finally:
        process.stop()


def normal_request(server: ServeProcess) -> bool:
    response = httpx.post(server.base_url + "/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})  # fmt: skip
    return response.status_code == 200


def connect(server: ServeProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def status_of(sock: socket.socket) -> int | None:
    """The status of the response waiting on `sock`, None if there is none."""
    with contextlib.suppress(OSError):
        head = sock.recv(65536)
        if head.startswith(b"HTTP/1.1 "):
            return int(head.split()[1])
    return None


class PeakMemory:
    """The server process's resident memory, sampled every 20 ms while in the block."""

    def __init__(self, server: ServeProcess) -> None:
        self.process = psutil.Process(server.process.pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def settled_rss(memory: PeakMemory) -> int:
    """Resident memory once it stops falling (freed buffers go back within a second or two)."""
    time.sleep(1.0)
    before = memory.rss()
    for _ in range(20):
        time.sleep(0.5)
        now = memory.rss()
        if now >= before - MB:
            return now
        before = now
    return before


def header_flood(server: ServeProcess, connections: int) -> list[int | None]:
    """Per connection: a request line, then 1 MiB header lines until the server answers."""
    line = b"X-Fill: " + b"a" * MB + b"\r\n"
    statuses = []
    for _ in range(connections):
        with connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            with contextlib.suppress(OSError):
                for _ in range(500):
                    sock.sendall(line)
                    if select.select([sock], [], [], 0)[0]:  # answered
                        break
            statuses.append(status_of(sock))
    return statuses


def test_a_header_flood_is_431_and_memory_stays_bounded(server):
    idle = settled_rss(PeakMemory(server))
    with PeakMemory(server) as memory, ThreadPoolExecutor(3) as pool:
        floods = [pool.submit(header_flood, server, 10) for _ in range(3)]
        time.sleep(0.5)
        assert normal_request(server)
        statuses = [status for flood in floods for status in flood.result()]
    assert statuses == [431] * 30
    assert memory.peak - idle < FLOOD_HEADROOM, (memory.peak - idle) / MB
    assert settled_rss(memory) - idle < AFTER_HEADROOM
    assert normal_request(server)


def test_many_header_fields_are_431(server):
    with connect(server) as sock:
        fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(101))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        assert status_of(sock) == 431


def half_sent_body(server: ServeProcess) -> socket.socket:
    """A request with a valid key and all but the last byte of a 4 MiB - 1 body; left open."""
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(BODY).encode() + b"\r\n\r\n")  # fmt: skip
    with contextlib.suppress(OSError):  # refused part way: the server closed it
        sock.sendall(b"a" * (BODY - 1))
    return sock


def test_hundreds_of_half_sent_bodies_hold_bounded_memory(server):
    idle = settled_rss(PeakMemory(server))
    with PeakMemory(server) as memory, ThreadPoolExecutor(32) as pool:
        socks = list(pool.map(lambda _: half_sent_body(server), range(400)))
        time.sleep(1.0)
        assert normal_request(server)
        for sock in socks:
            sock.settimeout(0.2)
        statuses = list(pool.map(status_of, socks))
        for sock in socks:
            sock.close()
    # The bodies that fit the budget wait for their last byte; the rest were refused.
    assert set(statuses) == {None, 503}, set(statuses)
    assert statuses.count(None) <= 64 * MB // (BODY - 64 * 2**10) + 1
    assert memory.peak - idle < FLOOD_HEADROOM, (memory.peak - idle) / MB
    assert settled_rss(memory) - idle < AFTER_HEADROOM, (settled_rss(memory) - idle) / MB
    assert normal_request(server)


def test_a_connection_past_the_limit_is_503_with_retry_after(server):
    socks = [connect(server) for _ in range(LIMIT_CONNECTIONS)]
    try:
        with connect(server) as extra:
            extra.settimeout(10)
            head = extra.recv(65536)
        assert head.startswith(b"HTTP/1.1 503 "), head
        assert b"retry-after: 1" in head.lower()
        assert b'"code":"server_overloaded"' in head
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.5)
    assert normal_request(server)


def test_clients_that_go_away_mid_body_leave_no_error_in_the_log(server):
    before = len(server.output())
    for _ in range(50):
        with connect(server) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b"a" * 500)  # fmt: skip
            time.sleep(0.01)
    time.sleep(1.0)
    assert normal_request(server)
    log = server.output()[before:]
    assert "Traceback" not in log and "ERROR" not in log, log[:3000]

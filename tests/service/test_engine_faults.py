"""The engine process killed (kill -9) under a standalone server streaming the real model: the
streams end at once with an error event, `/health` turns 503, no request waits, and the server
exits with status 1 for its supervisor to restart it."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from service.http_server import FAILED_EXIT_STATUS
from tests.service.servers import MODEL, ServeProcess

STREAM = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500,
          "ignore_eos": True, "stream": True}  # fmt: skip


def engine_process(server: ServeProcess) -> psutil.Process:
    """The spawned engine process (not multiprocessing's resource tracker)."""
    children = psutil.Process(server.process.pid).children()
    (engine,) = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
    return engine


def healthy(server: ServeProcess) -> bool:
    try:
        return httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def stream_until_end(server: ServeProcess, started) -> list[str]:
    with httpx.stream("POST", server.base_url + "/v1/completions", json=STREAM,
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 2:
                    started()
        return events


def test_a_killed_engine_fails_its_streams_and_the_server_exits_for_a_restart():
    server = ServeProcess([MODEL, "--engine-process", "--host", "127.0.0.1", "--max-model-len",
                           "1024", "--kv-cache-memory-gb", "0.25", "--policy", "dense"])  # fmt: skip
    try:
        server.wait_healthy(timeout=180)
        engine = engine_process(server)
        started: list[bool] = []
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream_until_end, server, lambda: started.append(True))
                       for _ in range(3)]  # fmt: skip
            deadline = time.monotonic() + 60
            while len(started) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(engine.pid, signal.SIGKILL)
            killed = time.monotonic()
            try:  # a request sent now is answered, whatever the answer
                late = httpx.post(server.base_url + "/v1/completions", timeout=10,
                                  json={**STREAM, "stream": False, "max_tokens": 2})  # fmt: skip
                assert late.status_code in (500, 503), late.text
            except httpx.TransportError:
                pass  # the server is already gone
            for stream in streams:
                events = stream.result(timeout=10)
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["error"]["code"] == "engine_error", events[-2]
        assert time.monotonic() - killed < 5  # the streams ended promptly
        assert not healthy(server)  # 503 while shutting down, then no server at all
        assert server.process.wait(timeout=30) == FAILED_EXIT_STATUS
        assert time.monotonic() - killed < 10
        assert "engine stopped" in server.output()
    finally:
        server.stop()

"""Helpers of the serving tests: real engines behind real HTTP (uvicorn on a free port)."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import uvicorn

from service.settings import PoolSpec, ServerSettings
from service.standalone import build_standalone_app
from sparse_core import EngineConfig, SparsityConfig

API_KEY = "test-key"
MODEL = "smollm2-135m-instruct"
# Compresses prompts longer than 64 tokens in all but the first two layers.
SPARSE = SparsityConfig(policy="snapkv", budget=64, window=16, sinks=4, full_layers=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text


@contextlib.contextmanager
def run_server(app, api_key: str | None) -> Iterator[Server]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield Server(f"http://127.0.0.1:{port}", api_key)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def standalone(
    engine: EngineConfig,
    pools: list[SparsityConfig],
    api_key: str | None = API_KEY,
    **limits: int,
) -> contextlib.AbstractContextManager[Server]:
    settings = ServerSettings(
        served_model_name=engine.model,
        max_model_len=engine.max_model_len,
        pools=[PoolSpec.of(p) for p in pools],
        api_key=api_key,
        **limits,
    )
    return run_server(build_standalone_app(engine, pools, settings), api_key)


def metric_values(text: str, name: str, **labels: str) -> list[float]:
    """Samples of a metric in Prometheus text format whose labels include `labels`."""
    values = []
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            values.append(float(match.group(3)))
    return values


def metric_sum(text: str, name: str, **labels: str) -> float:
    return sum(metric_values(text, name, **labels))


def wait_for(condition, timeout: float = 20.0, interval: float = 0.2):
    """Poll until `condition()` is truthy; returns its value or fails."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)

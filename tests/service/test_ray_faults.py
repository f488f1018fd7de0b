"""Faults under Ray Serve on a local CPU cluster: an engine replica killed (kill -9) while it
streams is replaced by Serve, its streams end with an error event, and new requests succeed; an
engine process that dies inside a replica fails Serve's health check, and the replica is
replaced the same way."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.service.servers import API_KEY, MODEL, wait_for
from tests.service.test_ray_serve import APP, ENGINE, ray_server  # noqa: F401 (the fixture)

# Slow: a cluster of its own (the fixture of test_ray_serve.py) and replicas restarted, ~2.5 min.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def replicas(app: str, deployment: str) -> list[dict]:
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()["applications"][app]
    return details["deployments"][deployment]["replicas"]


def running_pids(app: str, deployment: str) -> set[int]:
    return {r["pid"] for r in replicas(app, deployment) if r["state"] == "RUNNING"}


class Streams:
    """Streaming requests in threads; each keeps its events."""

    def __init__(self, url: str, body: dict, count: int) -> None:
        self.events: list[list[str]] = [[] for _ in range(count)]
        self.ended: list[float] = [0.0] * count  # time.monotonic() at each stream's end
        self.threads = [threading.Thread(target=self._run, args=(url, body, i), daemon=True)
                        for i in range(count)]  # fmt: skip
        for thread in self.threads:
            thread.start()

    def _run(self, url: str, body: dict, index: int) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events[index].append(line.removeprefix("data: "))
        self.ended[index] = time.monotonic()

    def generating(self) -> bool:
        return all(len(events) >= 2 for events in self.events)

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a stream did not end"


def ended_with_an_error(events: list[str]) -> bool:
    return events[-1] == "[DONE]" and "error" in json.loads(events[-2])


def complete(url: str, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 3}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(url, json=body, headers=headers, timeout=120)


LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 150,
        "ignore_eos": True, "stream": True}  # fmt: skip


def test_a_killed_engine_replica_is_replaced_and_new_requests_succeed(ray_server):  # noqa: F811
    before = running_pids(APP, ENGINE)
    assert len(before) == 2
    streams = Streams(ray_server.v1 + "/completions", LONG, 4)
    wait_for(streams.generating, timeout=60)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    streams.join(timeout=180)  # those on the victim ended with an error, the others finished
    failed = [i for i, events in enumerate(streams.events) if ended_with_an_error(events)]
    assert 1 <= len(failed) < 4, streams.events
    assert json.loads(streams.events[failed[0]][-2])["error"]["code"] == "engine_stopped"
    assert max(streams.ended[i] for i in failed) - killed < 10  # at once, not at a timeout
    wait_for(lambda: len(running_pids(APP, ENGINE) - before) == 1
             and len(running_pids(APP, ENGINE)) == 2, timeout=180, interval=1)  # fmt: skip
    for _ in range(4):
        assert complete(ray_server.v1 + "/completions").status_code == 200


@pytest.fixture
def engine_in_a_process(ray_server) -> Iterator[str]:  # noqa: F811
    """A second application: one replica whose engine runs in a process of its own, its health
    checked every second."""
    from ray import serve

    from service.ray_app import build_app

    args = {"model": "dummy:tiny", "engine": {"max_model_len": 4096, "kv_cache_memory_gb": 0.02},
            "sparsity": {"policy": "dense"}, "engine_process": True, "api_key": API_KEY,
            "health_check_period_s": 1, "health_check_timeout_s": 5,
            "num_cpus_per_replica": 0}  # fmt: skip
    serve.run(build_app(args), name="engine-process", route_prefix="/engine-process")
    try:
        yield f"{ray_server.base_url}/engine-process/v1"
    finally:
        serve.delete("engine-process")


def test_a_dead_engine_process_fails_the_health_check_and_its_replica_is_replaced(
    engine_in_a_process,
):
    deployment = "KVSparseEngine-dense"
    (replica,) = running_pids("engine-process", deployment)
    (engine,) = [c for c in psutil.Process(replica).children()
                 if "resource_tracker" not in " ".join(c.cmdline())]  # fmt: skip
    body = {**LONG, "model": "dummy:tiny", "max_tokens": 4000}
    streams = Streams(engine_in_a_process + "/completions", body, 2)
    wait_for(streams.generating, timeout=60)
    os.kill(engine.pid, signal.SIGKILL)
    streams.join(timeout=30)
    assert all(ended_with_an_error(events) for events in streams.events), streams.events
    wait_for(lambda: running_pids("engine-process", deployment) - {replica}, timeout=120,
             interval=1)  # fmt: skip
    wait_for(lambda: complete(engine_in_a_process + "/completions", "dummy:tiny").status_code == 200,
             timeout=60, interval=1)  # fmt: skip

"""Soak (slow): 10,000 requests against `kvsparse serve` on the real model, with random
streaming, disconnects, bad inputs and overload. Afterwards every pool is idle, the server's
memory is within 10% of where it stood after a warm-up, and a normal request succeeds.

    pytest -m slow tests/service/test_soak.py -s     # prints the figures docs/serving.md quotes
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter

import httpx
import psutil
import pytest

from tests.service.servers import MODEL, ServeProcess, metric_sum

TIME_LIMIT_S = 15 * 60
REQUESTS, WARM_UP, CLIENTS, SEED = 10_000, 500, 20, 0
MAX_INFLIGHT = 16  # below CLIENTS: some requests find the server full (429)
# Slow; the bound on its time is the test's own (TIME_LIMIT_S), not the suite's 900 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIME_LIMIT_S + 300)]
BAD = [{"prompt": "x", "max_tokens": "5"}, {"prompt": "x", "max_tokens": 0},
       {"prompt": "", "max_tokens": 2}, {"prompt": [10**9], "max_tokens": 2},
       {"prompt": "x", "seed": 2**64}, {"prompt": "x", "logprobs": 21},
       {"prompt": "x", "model": "gpt-4"}, {"prompt": "x" * 200_000, "max_tokens": 2}]  # fmt: skip


def body(rng: random.Random, stream: bool) -> dict:
    prompt = " ".join(rng.choice(["red", "box", "sky", "cat", "one", "two"]) for _ in range(
        rng.randint(1, 30)))  # fmt: skip
    extra = rng.choice([{}, {"kvsparse": {"policy": "dense"}}, {"temperature": 0.8, "seed": 3}])
    return {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 4), "stream": stream,
            **extra}  # fmt: skip


async def one(client: httpx.AsyncClient, rng: random.Random) -> str:
    """One random request; what happened to it."""
    kind = rng.choices(["whole", "stream", "disconnect", "bad"], [35, 30, 15, 20])[0]
    if kind == "bad":
        response = await client.post("/completions", json={"model": MODEL, **rng.choice(BAD)})
        assert response.status_code in (400, 404, 429), response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        return f"bad-{response.status_code}"
    if kind == "whole":
        response = await client.post("/completions", json=body(rng, False))
        assert response.status_code in (200, 429), response.text
        return f"whole-{response.status_code}"
    async with client.stream("POST", "/completions", json=body(rng, True)) as response:
        if response.status_code != 200:
            assert response.status_code == 429, await response.aread()
            return f"{kind}-429"
        lines = [line async for line in _lines(response, 2 if kind == "disconnect" else None)]
    if kind == "stream":
        assert lines[-1] == "data: [DONE]", lines[-3:]
    return f"{kind}-200"


async def _lines(response: httpx.Response, limit: int | None):
    count = 0
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line
            count += 1
            if count == limit:
                return  # leaving the block closes the connection mid-stream


async def load(base: str, count: int, seed: int) -> Counter:
    outcomes: Counter = Counter()
    rng = random.Random(seed)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            queue.get_nowait()
            outcome = await one(client, rng)
            outcomes[outcome] += 1
            if outcome.endswith("-429"):  # as a client would, not at once
                await asyncio.sleep(rng.uniform(0.2, 1.0))

    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=base + "/v1", timeout=120, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(CLIENTS)))
    return outcomes


def idle(server: ServeProcess) -> bool:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting",
             "kvsparse_kv_blocks_used"]  # fmt: skip
    return all(metric_sum(text, name, pool=pool) == 0 for name in names
               for pool in ("snapkv-64", "dense"))  # fmt: skip


def test_soak():
    server = ServeProcess([MODEL, "--host", "127.0.0.1", "--max-model-len", "1024",
                           "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "16",
                           "--policy", "snapkv", "--budget", "64", "--window", "16",
                           "--pools", "snapkv,dense", "--max-inflight-requests", str(MAX_INFLIGHT),
                           "--log-level", "warning"])  # fmt: skip
    try:
        server.wait_healthy(timeout=180)
        process = psutil.Process(server.process.pid)
        start = time.monotonic()
        warm = asyncio.run(load(server.base_url, WARM_UP, SEED))
        time.sleep(2)
        rss_start = process.memory_info().rss
        outcomes = asyncio.run(load(server.base_url, REQUESTS - WARM_UP, SEED + 1)) + warm
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 30
        while not idle(server):
            assert time.monotonic() < deadline, "pools not idle after the load"
            time.sleep(0.5)
        time.sleep(2)
        rss_end = process.memory_info().rss
        final = httpx.post(server.base_url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})  # fmt: skip
        print(f"\nsoak: {sum(outcomes.values())} requests in {elapsed:.0f} s; "
              f"{dict(sorted(outcomes.items()))}; RSS {rss_start / 2**20:.0f} MiB after "
              f"{WARM_UP} requests, {rss_end / 2**20:.0f} MiB at the end "
              f"({(rss_end / rss_start - 1) * 100:+.1f}%)")  # fmt: skip
        assert sum(outcomes.values()) == REQUESTS
        assert elapsed < TIME_LIMIT_S
        assert outcomes["stream-200"] and outcomes["disconnect-200"] and outcomes["bad-400"]
        assert any(k.endswith("-429") for k in outcomes)  # overload was reached
        assert abs(rss_end / rss_start - 1) < 0.10
        assert final.status_code == 200 and final.json()["usage"]["completion_tokens"] >= 1
        with contextlib.suppress(httpx.TransportError):
            assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()

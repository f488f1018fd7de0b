"""Ray Serve runs as many sequences at once as the engine can: nothing between the HTTP client
and the engine replica (the ingress' own limit, Serve's queues) holds requests back. Throughput
on a GPU follows the running batch, so this asserts the batch, read from the engine's step log.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.service.servers import API_KEY, MODEL, ray_serve_app

pytestmark = pytest.mark.ray

APP = "kvsparse-concurrency"
CLIENTS = 32


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The application as the chart deploys it (its environment, the builder and its args), one
    engine replica with room for 32 sequences; (base URL, the engine's step log)."""
    from service.ray_env import apply_serve_environment

    apply_serve_environment()
    step_log = tmp_path_factory.mktemp("ray") / "steps.jsonl"
    args = {
        "model": MODEL,
        "engine": {"max_model_len": 512, "max_num_seqs": CLIENTS, "kv_cache_memory_gb": 0.25,
                   "step_log": str(step_log)},
        "sparsity": {"policy": "snapkv", "budget": 64, "window": 16, "sinks": 4, "full_layers": 2},
        "api_key": API_KEY,
    }  # fmt: skip
    with ray_serve_app(args, APP) as app:
        yield app.v1, step_log


def test_32_concurrent_streams_run_at_least_24_sequences_at_once(served):
    base_url, step_log = served
    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=300)

    async def stream(i: int) -> int:
        chunks = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=96,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens = 0
        async for chunk in chunks:
            tokens += bool(chunk.choices and chunk.choices[0].text)
        return tokens

    async def run() -> list[int]:
        try:
            return await asyncio.gather(*(stream(i) for i in range(CLIENTS)))
        finally:
            await client.close()

    assert all(t > 0 for t in asyncio.run(run()))
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    running = max(s["num_decode_seqs"] + s["num_prefill_seqs"] for s in steps)
    assert running >= 24, f"the engine ran at most {running} of {CLIENTS} sequences at once"

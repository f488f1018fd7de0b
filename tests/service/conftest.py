"""Fixtures of the serving tests: standalone servers, loaded once per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.settings import parse_pools
from sparse_core import EngineConfig, SparsityConfig
from tests.service.servers import MODEL, SPARSE, Server, standalone


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "ray: starts a local Ray cluster with Ray Serve (about a minute on 2 cores)"
    )


@pytest.fixture(scope="session")
def real_server() -> Iterator[Server]:
    """SmolLM2-135M-Instruct, a snapkv pool (the default) and a dense one."""
    engine = EngineConfig(model=MODEL, max_model_len=1024, max_num_seqs=32, kv_cache_memory_gb=0.25)
    with standalone(engine, parse_pools("snapkv,dense", SPARSE)) as server:
        yield server


@pytest.fixture(scope="module")
def limits_server() -> Iterator[Server]:
    """Random weights of SmolLM2's shape (slow enough to keep requests in flight), at most 2
    requests in flight and 4 KiB request bodies."""
    engine = EngineConfig(model="dummy:smollm2-135m", max_model_len=512, kv_cache_memory_gb=0.05)
    sparsity = SparsityConfig(policy="dense")
    with standalone(engine, [sparsity], max_inflight_requests=2, max_request_bytes=4096) as server:
        yield server

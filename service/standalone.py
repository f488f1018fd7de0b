"""The standalone server: every pool's engine in this process, one uvicorn, `/metrics` here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI

from service.app import build_app
from service.errors import APIError
from service.messages import Chunk, GenerateRequest
from service.metrics import Metrics
from service.settings import PoolSpec, ServerSettings
from service.worker import EngineWorker
from sparse_core.config import EngineConfig, SparsityConfig


class LocalBackend:
    """Engines in this process, one per pool."""

    def __init__(self, workers: dict[str, EngineWorker]) -> None:
        self.workers = workers
        self._tasks: list[asyncio.Task] = []

    def stream(self, pool: str, request: GenerateRequest) -> AsyncIterator[Chunk]:
        return self.workers[pool].generate(request)

    def stopped_engines(self) -> str | None:
        """The pools whose engine has stopped (died), or None while all run."""
        stopped = [name for name, w in self.workers.items() if not w.healthy()]
        return ", ".join(stopped) if stopped else None

    async def check_health(self) -> None:
        stopped = self.stopped_engines()
        if stopped:
            raise APIError(503, f"engine stopped: {stopped}", code="engine_stopped")

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(w.publish_metrics_forever()) for w in self.workers.values()
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self.workers.values():
            worker.shutdown()


def build_standalone_app(
    engine_config: EngineConfig,
    pools: list[SparsityConfig],
    settings: ServerSettings,
    log_prompts: bool = False,
    engine: str = "native",
    engine_process: bool | None = None,
) -> FastAPI:
    """Load every pool's engine (before the server listens) and wrap them in the app
    (`app.state.backend` is the LocalBackend)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = Metrics.prometheus(registry)
    workers = {}
    for sparsity in pools:
        name = PoolSpec.of(sparsity).name
        recorder = metrics.recorder(model_name=settings.served_model_name, pool=name)
        workers[name] = EngineWorker.start(
            engine_config, sparsity, recorder, log_prompts, engine, engine_process
        )
    backend = LocalBackend(workers)
    app = build_app(backend, settings, registry)
    app.state.backend = backend
    return app

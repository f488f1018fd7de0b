"""Ray Serve mode: an OpenAI ingress deployment in front of one engine deployment per pool.

`build_app(args)` is the application builder, usable from a Serve config file:

    applications:
      - name: kvsparse
        route_prefix: /
        import_path: service.ray_app:build_app
        args: {model: smollm2-135m-instruct, min_replicas: 1, max_replicas: 4, ...}

(`RayAppConfig` lists the arguments). `kvsparse serve --ray` builds the same application from its
flags. Each engine replica wraps one engine; the ingress runs the same ASGI app as the standalone
server, with `RayBackend` sending requests to the engine replicas through deployment handles
routed by `service.router.KVCapacityRouter`.

What keeps it at the standalone server's speed (docs/serving.md, "Ray Serve at full speed"):
the ingress admits as many requests as `max_inflight_requests` (Serve's own default of 5 would
hold the rest in its queue), Serve runs in its throughput-optimized mode (`service.ray_env`),
and engine replicas stream tokens to the ingress `stream_interval` at a time. Clients
reach the ingress through Serve's HTTP proxy, a few milliseconds more to the first token (the
same section says how much, and what HAProxy changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import RequestRouter

from service.app import build_app as build_asgi_app
from service.errors import APIError, overloaded
from service.messages import Chunk, GenerateRequest
from service.metrics import Metrics
from service.settings import (
    PoolSpec,
    ServerSettings,
    apply_serving_defaults,
    parse_pools,
    resolve_api_key,
)
from service.streams import every_n_tokens

if TYPE_CHECKING:
    from sparse_core.config import EngineConfig, SparsityConfig


# Serve's request router for the engine deployments unless request_router_class names another.
DEFAULT_REQUEST_ROUTER = "service.router:KVCapacityRouter"


def _check_router_class(path: str) -> None:
    """A clear error, at build time, for a request_router_class that Serve could not use: an
    import path, "module:Class" or "module.Class" as Serve takes it."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        router = getattr(importlib.import_module(module), name) if module and name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"request_router_class {path!r} cannot be imported: {e}") from e
    if not (isinstance(router, type) and issubclass(router, RequestRouter)):
        raise ValueError(
            f"request_router_class {path!r} must name a ray.serve.request_router.RequestRouter "
            "subclass, as 'module:Class' or 'module.Class'"
        )


@dataclass
class RayAppConfig:
    """Arguments of `build_app` (all optional)."""

    model: str = "smollm2-135m-instruct"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    sparsity: dict[str, Any] = field(default_factory=dict)  # SparsityConfig fields
    pools: str | None = None  # "snapkv,dense,snapkv:256": one engine deployment per entry
    served_model_name: str | list[str] | None = None  # one name or several (metrics: the first)
    api_key: str | None = None  # else $KVSPARSE_API_KEY in the ingress replicas' environment
    # Per ingress replica, beyond which requests get 429; None: 4 x max_num_seqs for each engine
    # replica the pools can scale to, shared among the ingress replicas.
    max_inflight_requests: int | None = None
    max_request_bytes: int = 4 * 2**20
    log_prompts: bool = False
    engine_kind: str = "native"  # or "vllm": stock vLLM with kvsparse's plugin
    engine_process: bool | None = None  # each engine in a process of its own; None: on a GPU
    # How often Serve checks each replica's health (an engine that died fails it; Serve then
    # replaces the replica), and how long a check may take.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    # Engine deployments (each pool scales on its own).
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 16
    # More of Serve's AutoscalingConfig fields (upscale_delay_s, look_back_period_s, ...).
    autoscaling_config: dict[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int | None = None  # per replica; default 2 x max_num_seqs
    max_queued_requests: int = 256  # per caller, beyond which requests get 503
    # Tokens per message from an engine replica to the ingress (the first token goes at once).
    stream_interval: int = 4
    # GPUs per engine replica; None: tensor_parallel_size. A fraction (0.5) shares a GPU between
    # replicas, each within its own gpu_memory_limit_gb (tensor parallel size 1 only).
    num_gpus_per_replica: float | None = None
    num_cpus_per_replica: float = 1
    routing_stats_period_s: float = 1.0
    # Serve's request router for the engine deployments, as an import path (Serve's
    # RequestRouterConfig.request_router_class): ours by default; another router, such as Ray
    # Serve LLM's PrefixCacheAffinityRouter, in its place (docs/serving.md, "Routing").
    request_router_class: str = DEFAULT_REQUEST_ROUTER
    ingress_replicas: int = 1
    # A replica being stopped (scaled down, or its pod terminated) waits this long for its
    # requests before it is killed: below Kubernetes' 30 s grace period (the chart checks).
    graceful_shutdown_timeout_s: float = 25.0
    ingress_num_cpus: float = 0  # the ingress is I/O bound; engines get the CPUs

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> RayAppConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(
                f"unknown kvsparse Serve argument(s) {unknown}; known: {sorted(known)}"
            )
        # Checked and converted by their types: `helm --set` hands numbers over as strings
        # (serve.extraArgs.num_gpus_per_replica=0.5 arrives as "0.5").
        try:
            return TypeAdapter(cls).validate_python(args)
        except ValidationError as e:
            raise ValueError(f"invalid kvsparse Serve argument(s): {e}") from None

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        _check_router_class(self.request_router_class)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration, with a server's defaults where `engine` leaves a field
        unset (service.settings.apply_serving_defaults). Any EngineConfig field but `model`
        (an argument of its own); strings are read as their `kvsparse serve` flags are."""
        from sparse_core.config import EngineConfig
        from sparse_core.engine_args import config_from_mapping
        from sparse_core.models.prequantized import (
            read_checkpoint_quantization,
            resolve_quantization,
        )

        if "model" in self.engine:
            raise ValueError("the model is the `model` argument, not an `engine` field")
        engine_args = {**self.engine, "model": self.model}
        apply_serving_defaults(engine_args)
        engine = config_from_mapping(EngineConfig, engine_args, "engine")
        # A pre-quantized checkpoint's quantization (when this host can read its config.json).
        return resolve_quantization(engine, read_checkpoint_quantization(self.model))

    def sparsity_config(self) -> SparsityConfig:
        """The base sparsity of the pools: any SparsityConfig field, read as `engine` is; what
        `sparsity` leaves unset takes SparsityConfig's default, as everywhere."""
        from sparse_core.config import SparsityConfig
        from sparse_core.engine_args import config_from_mapping

        return config_from_mapping(SparsityConfig, self.sparsity, "sparsity")

    def served_model_names(self) -> list[str]:
        name = self.served_model_name or self.model
        return [name] if isinstance(name, str) else list(name)

    def ingress_max_inflight(self, engine: EngineConfig, num_pools: int) -> int:
        """Requests one ingress replica holds at once (running, queued, streaming)."""
        if self.max_inflight_requests is not None:
            return self.max_inflight_requests
        capacity = 4 * engine.max_num_seqs * self.max_replicas * num_pools
        return max(1, -(-capacity // self.ingress_replicas))


def replica_resources(
    tensor_parallel_size: int, num_cpus: float, num_gpus: float | None
) -> dict[str, Any]:
    """Deployment options reserving a replica's devices (num_gpus None: no GPU).

    The engine runs its tensor-parallel ranks as processes it spawns itself, so a replica with
    tensor parallel size N holds all of them: one placement-group bundle of N GPUs (and N times
    `num_cpus`), packed on one node and visible to the replica.
    """
    actor: dict[str, Any] = {"num_cpus": num_cpus * tensor_parallel_size}
    if num_gpus is not None:
        actor["num_gpus"] = num_gpus
    if tensor_parallel_size == 1:
        return {"ray_actor_options": actor}
    bundle = {"CPU": actor["num_cpus"], **({"GPU": num_gpus} if num_gpus is not None else {})}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [bundle],
        "placement_group_strategy": "STRICT_PACK",
    }


@serve.deployment(name="KVSparseEngine")
class EngineDeployment:
    """One engine per replica."""

    async def __init__(
        self,
        engine: EngineConfig,
        sparsity: SparsityConfig,
        served_model_name: str,
        pool: str,
        log_prompts: bool,
        engine_kind: str = "native",
        stream_interval: int = RayAppConfig.stream_interval,
        engine_process: bool | None = None,
    ) -> None:
        from service.worker import EngineWorker

        replica = serve.get_replica_context().replica_id.unique_id
        recorder = Metrics.ray().recorder(model_name=served_model_name, pool=pool, replica=replica)
        self.worker = EngineWorker.start(
            engine,
            sparsity,
            recorder,
            log_prompts,
            engine_kind,
            engine_process,
        )
        self._metrics_task = asyncio.create_task(self.worker.publish_metrics_forever())
        self.stream_interval = stream_interval

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk | APIError]:
        # An APIError is yielded, not raised: Ray would wrap a raised one in its own error type.
        try:
            # Closed as soon as this generator is (a caller that went away): the request is
            # aborted then, not when the stream is collected.
            chunks = every_n_tokens(self.worker.generate(request), self.stream_interval)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        except APIError as exc:
            yield exc

    def record_routing_stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.worker.routing_stats())

    def check_health(self) -> None:
        if not self.worker.healthy():
            raise RuntimeError("the engine has stopped")

    def ping(self) -> bool:
        return self.worker.healthy()

    def __del__(self) -> None:
        self.worker.shutdown()


class RayBackend:
    """Requests go to a pool's engine deployment through its handle (and our router)."""

    def __init__(self, engines: dict[str, DeploymentHandle]) -> None:
        self.engines = engines

    async def stream(self, pool: str, request: GenerateRequest) -> AsyncIterator[Chunk]:
        from ray.exceptions import ActorUnavailableError, RayActorError
        from ray.serve.exceptions import BackPressureError

        response = self.engines[pool].options(stream=True).generate.remote(request)
        done = False
        try:
            async for item in response:
                if isinstance(item, APIError):
                    raise item
                yield item
            done = True
        except BackPressureError:
            raise overloaded(
                f"the {pool} engines' queues are full; retry later", status=503
            ) from None
        except (RayActorError, ActorUnavailableError) as exc:  # the replica died
            message = f"the {pool} engine replica stopped ({type(exc).__name__}); retry"
            raise APIError(503, message, code="engine_stopped", retry_after=1) from None
        finally:
            if not done:
                # Aborts the request in the replica, freeing its KV blocks. Cancelling a request
                # that was never assigned re-raises why (e.g. BackPressureError): not ours to see.
                with contextlib.suppress(Exception):
                    response.cancel()

    async def check_health(self) -> None:
        for pool, handle in self.engines.items():
            try:
                healthy = await asyncio.wait_for(handle.ping.remote(), timeout=10)
            except Exception:
                healthy = False
            if not healthy:
                raise APIError(503, f"no healthy engine for pool {pool}", code="engine_stopped")

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    def __init__(self, engines: dict[str, DeploymentHandle], settings: ServerSettings) -> None:
        settings = dataclasses.replace(
            settings, api_key=resolve_api_key(settings.api_key, os.environ)
        )
        self._app = build_asgi_app(RayBackend(engines), settings)

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


def _uses_gpu(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def engine_options(cfg: RayAppConfig, engine: EngineConfig) -> dict[str, Any]:
    """Serve options of each pool's engine deployment."""
    tensor_parallel_size = engine.tensor_parallel_size
    num_gpus = None
    if _uses_gpu(engine.device):
        num_gpus = cfg.num_gpus_per_replica or tensor_parallel_size
        if tensor_parallel_size > 1 and num_gpus != tensor_parallel_size:
            raise ValueError(
                f"num_gpus_per_replica ({num_gpus}) must equal tensor_parallel_size "
                f"({tensor_parallel_size}): a tensor-parallel replica holds one GPU per rank"
            )
    autoscaling = {
        **cfg.autoscaling_config,
        "min_replicas": cfg.min_replicas,
        "max_replicas": cfg.max_replicas,
        "target_ongoing_requests": cfg.target_ongoing_requests,
    }
    return {
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": cfg.max_ongoing_requests or 2 * engine.max_num_seqs,
        "max_queued_requests": cfg.max_queued_requests,
        "request_router_config": RequestRouterConfig(
            request_router_class=cfg.request_router_class,
            request_routing_stats_period_s=cfg.routing_stats_period_s,
            request_routing_stats_timeout_s=max(cfg.routing_stats_period_s, 5.0),
        ),
        **replica_resources(tensor_parallel_size, cfg.num_cpus_per_replica, num_gpus),
    }


def ingress_options(cfg: RayAppConfig, max_inflight: int) -> dict[str, Any]:
    """Serve options of the ingress deployment: it takes every request it may hold in flight
    (beyond them it answers 429 itself), so Serve never queues requests in front of it."""
    return {
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "num_replicas": cfg.ingress_replicas,
        "max_ongoing_requests": max_inflight,
        "ray_actor_options": {"num_cpus": cfg.ingress_num_cpus},
    }


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application (ingress + engine deployments) from `RayAppConfig` arguments."""
    from sparse_core.models.prequantized import describe_checkpoint_quantization

    cfg = RayAppConfig.from_dict(dict(args))
    engine = cfg.engine_config()
    pools = parse_pools(cfg.pools, cfg.sparsity_config())
    served_names = cfg.served_model_names()
    served_name = served_names[0]
    options = engine_options(cfg, engine)
    engines = {}
    for sparsity in pools:
        pool = PoolSpec.of(sparsity).name
        engines[pool] = EngineDeployment.options(name=f"KVSparseEngine-{pool}", **options).bind(
            engine, sparsity, served_name, pool,
            cfg.log_prompts, cfg.engine_kind, cfg.stream_interval, cfg.engine_process,
        )  # fmt: skip
    max_inflight = cfg.ingress_max_inflight(engine, len(pools))
    settings = ServerSettings(
        served_model_names=served_names,
        max_model_len=engine.max_model_len,
        pools=[PoolSpec.of(p) for p in pools],
        quantization=engine.quantization,
        checkpoint_quantization=describe_checkpoint_quantization(engine.model),
        kv_cache_dtype=engine.kv_cache_dtype,
        api_key=cfg.api_key,
        max_inflight_requests=max_inflight,
        max_request_bytes=cfg.max_request_bytes,
    )
    return OpenAIIngress.options(**ingress_options(cfg, max_inflight)).bind(engines, settings)

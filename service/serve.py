"""`kvsparse serve [MODEL]`: the OpenAI-compatible server, standalone or on Ray Serve (`--ray`)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from service.settings import (
    API_KEY_ENV,
    apply_serving_defaults,
    check_api_key,
    resolve_api_key,
)
from sparse_core.config import FP8_IF_SUPPORTED
from sparse_core.engine_args import BY_DEST, Default, add_config_args, configs_from_args

if TYPE_CHECKING:
    from sparse_core.config import EngineConfig, SparsityConfig

logger = logging.getLogger(__name__)

FP8_DEFAULT_SHOWN = (
    FP8_IF_SUPPORTED + ": fp8 on a GPU with FP8 tensor cores (compute capability 8.9+), else {off}"
)
# The engine flags' defaults for a server, which service.settings.apply_serving_defaults fills
# in where the flags leave them unset (as it does for a Serve config).
SERVE_DEFAULTS = {
    "max_num_batched_tokens": Default(
        None, "expected_input_len, one typical prompt per step (a longer one runs alone)"
    ),
    "space_admissions": Default(None, "on"),
    "quantization": Default(FP8_IF_SUPPORTED, FP8_DEFAULT_SHOWN.format(off="none")),
    "kv_cache_dtype": Default(FP8_IF_SUPPORTED, FP8_DEFAULT_SHOWN.format(off="auto")),
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as --model")
    add_config_args(parser, SERVE_DEFAULTS)
    server = parser.add_argument_group("server")
    server.add_argument(
        "--engine",
        choices=("native", "vllm"),
        default="native",
        help="native: our engine; vllm: stock vLLM with kvsparse's plugin (needs vLLM installed)",
    )
    server.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each engine in a process of its own (default: on a GPU; on a CPU the engine "
        "steps on a thread of the server)",
    )
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}); an empty "
        "key is an error",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients send as model, one or several (metrics carry the first); "
        "default: the model argument",
    )
    server.add_argument(
        "--pools",
        default=None,
        help="sparsity pools requests may choose with 'kvsparse': {'policy', 'budget'}: "
        "POLICY[:BUDGET],... (default: only the --policy/--budget one)",
    )
    server.add_argument(
        "--max-inflight-requests",
        type=int,
        default=None,
        help="requests in flight before new ones get 429 (default: 4 x max-num-seqs per pool; "
        "with --ray, that per engine replica the pools can scale to)",
    )
    server.add_argument("--max-request-bytes", type=int, default=4 * 2**20)
    server.add_argument(
        "--max-buffered-body-bytes",
        type=int,
        default=64 * 2**20,
        help="bytes that request bodies still being received may hold together, beyond each "
        "one's first 64 KiB (else 503 with Retry-After)",
    )
    server.add_argument(
        "--limit-connections",
        type=int,
        default=None,
        help="open connections; one more is answered 503 with Retry-After (default: 2 x "
        "max-inflight-requests)",
    )
    server.add_argument(
        "--limit-request-header-bytes",
        type=int,
        default=64 * 2**10,
        help="a request's line and headers together (else 431)",
    )
    server.add_argument(
        "--limit-request-fields", type=int, default=100, help="header fields (else 431)"
    )
    timeouts = parser.add_argument_group("timeouts (seconds)")
    timeouts.add_argument(
        "--timeout-request-header",
        type=float,
        default=10.0,
        help="a request's headers must arrive within this of the connection (else 408)",
    )
    timeouts.add_argument(
        "--timeout-request-body",
        type=float,
        default=30.0,
        help="a request's body must arrive within this of its headers (else 408)",
    )
    timeouts.add_argument(
        "--timeout-keep-alive", type=float, default=5.0, help="idle kept-alive connections close"
    )
    timeouts.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=25.0,
        help="on SIGTERM, requests in flight get this long (below Kubernetes' 30 s grace); "
        "streams still running are then ended with an error event; a second signal exits now",
    )
    server.add_argument("--log-prompts", action="store_true", help="log prompts (off: never)")
    server.add_argument("--log-level", default="info")
    ray = parser.add_argument_group("ray serve (--ray)")
    ray.add_argument("--ray", action="store_true", help="run on Ray Serve")
    ray.add_argument(
        "--ray-address", default=None, help="an existing cluster ('auto'); default: start one"
    )
    ray.add_argument("--min-replicas", type=int, default=1)
    ray.add_argument("--max-replicas", type=int, default=1)
    ray.add_argument("--target-ongoing-requests", type=float, default=16)
    ray.add_argument("--max-ongoing-requests", type=int, default=None)
    ray.add_argument("--max-queued-requests", type=int, default=256)
    ray.add_argument("--num-cpus-per-replica", type=float, default=1)
    ray.add_argument(
        "--num-gpus-per-replica",
        type=float,
        default=None,
        help="GPUs per engine replica (default: tensor-parallel-size); 0.5 puts two on one GPU",
    )
    ray.add_argument(
        "--stream-interval",
        type=int,
        default=4,
        help="tokens per message from an engine replica to the ingress (the first goes at once)",
    )
    ray.add_argument(
        "--metrics-export-port",
        type=int,
        default=8080,
        help="Prometheus port of the Ray cluster this command starts",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    args.model = serve_model(args.model_arg, args.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    args.api_key = resolve_api_key(args.api_key, os.environ)
    check_api_key(args.api_key)  # before the model loads
    if args.api_key is None and not _is_loopback(args.host):
        logger.warning(
            "serving on %s without an API key: anyone who can reach port %d can use the model; "
            "set --api-key or $%s",
            args.host,
            args.port,
            API_KEY_ENV,
        )
    engine_config, sparsity = serving_configs(args)
    if args.ray:
        return _serve_ray(args, engine_config, sparsity)
    return _serve_standalone(args, engine_config, sparsity)


def serve_model(positional: str | None, flag: str) -> str:
    """The model of `kvsparse serve [MODEL] [--model M]`: either form, not two different ones,
    and not a word that a boolean flag was given by mistake (`--space-admissions false` leaves
    `false` to MODEL: those flags take no value)."""
    if positional is None:
        return flag
    if positional.lower() in _BOOLEAN_WORDS:
        raise ValueError(
            f"MODEL {positional!r} looks like the value of a boolean flag; those take none "
            "(--space-admissions / --no-space-admissions)"
        )
    default = BY_DEST["model"].default
    if flag not in (default, positional):
        raise ValueError(f"two models given: MODEL {positional!r} and --model {flag!r}")
    return positional


_BOOLEAN_WORDS = ("true", "false", "on", "off", "yes", "no")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def serving_configs(args: argparse.Namespace) -> tuple[EngineConfig, SparsityConfig]:
    """The engine and sparsity configurations of `kvsparse serve ARGS`, with a server's defaults
    for the engine flags left unset."""
    from sparse_core.models.prequantized import read_checkpoint_quantization, resolve_quantization

    apply_serving_defaults(vars(args))
    engine, sparsity = configs_from_args(args)
    # A pre-quantized checkpoint's quantization, known (and reported) before the engines load.
    return resolve_quantization(engine, read_checkpoint_quantization(engine.model)), sparsity


def _serve_standalone(args: argparse.Namespace, engine_config, sparsity) -> int:
    from service.http_server import ConnectionLimits, Server, ServerConfig
    from service.settings import PoolSpec, ServerSettings, parse_pools
    from service.standalone import build_standalone_app
    from sparse_core.engine.device import config_on_device
    from sparse_core.models.prequantized import describe_checkpoint_quantization

    # Resolved for this host's device, which the engines share, so /v1/models says what runs.
    engine_config = config_on_device(engine_config)
    pools = parse_pools(args.pools, sparsity)
    max_inflight = args.max_inflight_requests or 4 * engine_config.max_num_seqs * len(pools)
    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model],
        max_model_len=engine_config.max_model_len,
        pools=[PoolSpec.of(p) for p in pools],
        quantization=engine_config.quantization,
        checkpoint_quantization=describe_checkpoint_quantization(engine_config.model),
        kv_cache_dtype=engine_config.kv_cache_dtype,
        api_key=args.api_key,
        max_inflight_requests=max_inflight,
        max_request_bytes=args.max_request_bytes,
        max_buffered_body_bytes=args.max_buffered_body_bytes,
        timeout_request_body_s=args.timeout_request_body,
    )
    app = build_standalone_app(
        engine_config,
        pools,
        settings,
        log_prompts=args.log_prompts,
        engine=args.engine,
        engine_process=args.engine_process,
    )
    config = ServerConfig(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        limits=ConnectionLimits(
            timeout_request_header=args.timeout_request_header,
            limit_request_header_bytes=args.limit_request_header_bytes,
            limit_request_fields=args.limit_request_fields,
            limit_connections=args.limit_connections or 2 * max_inflight,
        ),
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
    server = Server(config, app.state.drain, app.state.backend.stopped_engines)
    server.run()
    return server.exit_status


def _serve_ray(args: argparse.Namespace, engine_config, sparsity) -> int:
    from service.ray_env import apply_serve_environment

    apply_serve_environment()  # before Ray is imported and its cluster started (which inherits it)
    import ray
    from ray import serve

    from service.ray_app import build_app

    engine = dataclasses.asdict(engine_config)
    engine.pop("model")
    config = {
        "model": args.model,
        "engine": engine,
        "sparsity": dataclasses.asdict(sparsity),
        "pools": args.pools,
        "served_model_name": args.served_model_name,
        "api_key": args.api_key,
        "max_request_bytes": args.max_request_bytes,
        "log_prompts": args.log_prompts,
        "engine_kind": args.engine,
        "engine_process": args.engine_process,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "target_ongoing_requests": args.target_ongoing_requests,
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "num_cpus_per_replica": args.num_cpus_per_replica,
        "num_gpus_per_replica": args.num_gpus_per_replica,
        "stream_interval": args.stream_interval,
    }
    if args.max_inflight_requests:
        config["max_inflight_requests"] = args.max_inflight_requests
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        ray.init(_metrics_export_port=args.metrics_export_port)
    # SIGTERM (docker stop, kill) also shuts Serve and the cluster this command started down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(config), name="kvsparse", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0

"""What the HTTP layer needs to know about the server: model name, sparsity pools, limits.

A *pool* is a set of engines with one sparsity configuration. The engine's sparsity is fixed per
engine, so a per-request choice of policy or budget (`"kvsparse": {"policy": ..., "budget": ...}`)
selects among the pools the server was started with; anything else is refused with 400. That is
the server's limit: requests cannot make an engine keep more KV than it was sized for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.errors import APIError
from service.protocol import KVSparseOptions
from sparse_core.config import FP8_IF_SUPPORTED, EngineConfig, SparsityConfig

API_KEY_ENV = "KVSPARSE_API_KEY"
# Of each request's body, what it may hold outside `ServerSettings.max_buffered_body_bytes`: the
# body of a typical request (a few thousand tokens of prompt), so that such requests are served
# while large bodies are being received.
BODY_BYTES_OUTSIDE_BUDGET = 64 * 2**10


def resolve_api_key(given: str | None, environ: Mapping[str, str]) -> str | None:
    """The key given (--api-key, a Serve config's `api_key`), else $KVSPARSE_API_KEY; None
    serves without authentication."""
    return given if given is not None else environ.get(API_KEY_ENV)


def check_api_key(key: str | None) -> None:
    """An empty key (`--api-key "$KEY"` with KEY unset) is an error, not authentication off."""
    if key is not None and not key.strip():
        raise ValueError(
            f"the API key (--api-key, or ${API_KEY_ENV}) is empty (an unset shell variable?); "
            "give a key, or leave both out to serve without authentication"
        )


def apply_serving_defaults(engine_args: dict[str, Any]) -> None:
    """A server's EngineConfig fields, where `engine_args` leaves them unset (absent or None).
    A server is judged by time to first token, an offline batch by throughput:

    - max_num_batched_tokens: expected_input_len, one typical prompt per step (a longer one
      runs alone in its step), so that a request that finds no prompt queued waits for at most
      the step in flight and its own. Serving long prompts it kept the throughput of two
      prompts per step and cut TTFT p50.
    - space_admissions: on, so that a burst of requests does not finish in lockstep and come
      back faster than one prefill per step can take them.

    Both are measured in docs/benchmarks.md. And where `engine_args` has no key for them (a
    Serve config that leaves them out; `kvsparse serve`'s flags default to it):

    - quantization and kv_cache_dtype: "fp8_if_supported", FP8 weights and KV cache on a GPU
      with FP8 tensor cores (the RTX 4090, Hopper), none elsewhere (a null or "none" turns
      them off)."""
    for name in ("quantization", "kv_cache_dtype"):
        engine_args.setdefault(name, FP8_IF_SUPPORTED)
    if engine_args.get("max_num_batched_tokens") is None:
        typical = engine_args.get("expected_input_len")
        engine_args["max_num_batched_tokens"] = typical or EngineConfig.expected_input_len
    if engine_args.get("space_admissions") is None:
        engine_args["space_admissions"] = True


@dataclass(frozen=True)
class PoolSpec:
    """A pool as the HTTP layer sees it (no engine imports: the Ray ingress stays torch-free)."""

    policy: str
    budget: int | None  # None: dense
    # Which layers keep every token, as configured: "auto" (the model's calibrated profile),
    # unset (its profile where the engine finds one, else the first 3: the metric
    # kvsparse_layer_plan_info says which), "per-layer budgets", or the layers given.
    full_layers: str = "all"

    @classmethod
    def of(cls, sparsity: SparsityConfig) -> PoolSpec:
        if not sparsity.compresses:
            return cls(sparsity.policy, None)
        return cls(sparsity.policy, sparsity.budget, describe_full_layers(sparsity))

    @property
    def name(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}-{self.budget}"

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "policy": self.policy, "budget": self.budget,
                "full_layers": self.full_layers}  # fmt: skip


def describe_full_layers(sparsity: SparsityConfig) -> str:
    """What a compressing pool keeps whole, as /v1/models reports it."""
    if sparsity.layer_budgets is not None:
        return "per-layer budgets" + (" (calibrated)" if sparsity.layer_budgets == "auto" else "")
    spec = sparsity.full_layers
    if spec is None:
        return "calibrated profile, else first 3"
    if spec == "auto":
        return "auto (calibrated profile)"
    return f"first {spec}" if isinstance(spec, int) else ",".join(map(str, spec))


def parse_pools(text: str | None, base: SparsityConfig) -> list[SparsityConfig]:
    """`"snapkv,dense,snapkv:256"`: POLICY[:BUDGET] entries on top of the base sparsity flags;
    None or empty: the base configuration alone."""
    if not text:
        return [base]
    pools = []
    for entry in text.split(","):
        policy, _, budget = entry.strip().partition(":")
        changes: dict[str, object] = {"policy": policy}
        if budget:
            try:
                changes["budget"] = int(budget)
            except ValueError:
                raise ValueError(f"pool {entry!r}: the budget must be an integer") from None
        pools.append(dataclasses.replace(base, **changes))
    names = [PoolSpec.of(p).name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"pools must differ: {names}")
    return pools


@dataclass
class ServerSettings:
    # The names clients may send as "model" (vLLM's --served-model-name takes several); the
    # first is the one metrics carry.
    served_model_names: list[str]
    max_model_len: int
    pools: list[PoolSpec]
    api_key: str | None = None
    # Requests in flight at once (running, queued, streaming) before new ones get 429: the
    # bound on what one server holds in memory.
    max_inflight_requests: int = 256
    max_request_bytes: int = 4 * 2**20
    # Bytes that bodies still being received may hold together, beyond each one's first
    # `BODY_BYTES_OUTSIDE_BUDGET`: a request that finds them spent gets 503 with Retry-After,
    # so that many half-sent bodies hold a bounded amount of memory.
    max_buffered_body_bytes: int = 64 * 2**20
    max_choices: int = 16  # prompts x n per request
    # What the engines compute and store in (EngineConfig.quantization / kv_cache_dtype),
    # reported by /v1/models, with the checkpoint's own quantization when it is pre-quantized
    # (e.g. "compressed-tensors FP8-Dynamic": quantization "fp8" from its stored weights).
    quantization: str | None = None
    checkpoint_quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # A body not received whole within this is answered 408 (a client trickling it holds a
    # connection, and a shutdown, no longer).
    timeout_request_body_s: float = 30.0

    def __post_init__(self) -> None:
        check_api_key(self.api_key)
        if not self.served_model_names or not all(n.strip() for n in self.served_model_names):
            raise ValueError(f"served model names must be non-empty, got {self.served_model_names}")

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]

    def select_pool(self, options: KVSparseOptions | None) -> PoolSpec:
        if options is None or (options.policy is None and options.budget is None):
            return self.pools[0]
        for pool in self.pools:
            if options.policy in (None, pool.policy) and options.budget in (None, pool.budget):
                return pool
        asked = ", ".join(f"{k}={v}" for k, v in options.model_dump(exclude_none=True).items())
        served = "; ".join(
            p.policy if p.budget is None else f"{p.policy} budget {p.budget}" for p in self.pools
        )
        raise APIError(
            400,
            f"no engine pool serves kvsparse {asked}; this server runs: {served}",
            param="kvsparse",
            code="unsupported_sparsity",
        )

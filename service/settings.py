"""What the HTTP layer needs to know about the server: model name, sparsity pools, limits.

A *pool* is a set of engines with one sparsity configuration. The engine's sparsity is fixed per
engine, so a per-request choice of policy or budget (`"kvsparse": {"policy": ..., "budget": ...}`)
selects among the pools the server was started with; anything else is refused with 400. That is
the server's limit: requests cannot make an engine keep more KV than it was sized for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparse_core.config import SparsityConfig

from service.errors import APIError
from service.protocol import KVSparseOptions


@dataclass
class PoolSpec:
    sparsity: SparsityConfig

    @property
    def name(self) -> str:
        s = self.sparsity
        return s.policy if not s.compresses else f"{s.policy}-{s.budget}"

    def describe(self) -> dict[str, object]:
        s = self.sparsity
        return {"name": self.name, "policy": s.policy, "budget": s.budget if s.compresses else None}


def parse_pools(text: str | None, base: SparsityConfig) -> list[PoolSpec]:
    """`"snapkv,dense,snapkv:256"`: POLICY[:BUDGET] entries on top of the base sparsity flags;
    None or empty: the base configuration alone."""
    if not text:
        return [PoolSpec(base)]
    pools = []
    for entry in text.split(","):
        policy, _, budget = entry.strip().partition(":")
        try:
            changes: dict[str, object] = {"policy": policy}
            if budget:
                changes["budget"] = int(budget)
        except ValueError:
            raise ValueError(f"pool {entry!r}: the budget must be an integer") from None
        pools.append(PoolSpec(dataclasses.replace(base, **changes)))
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"pools must differ: {names}")
    return pools


@dataclass
class ServerSettings:
    served_model_name: str
    max_model_len: int
    pools: list[PoolSpec]
    api_key: str | None = None
    # Requests in flight at once (running, queued, streaming) before new ones get 429: the
    # bound on what one server holds in memory.
    max_inflight_requests: int = 256
    max_request_bytes: int = 4 * 2**20
    max_choices: int = 16  # prompts x n per request

    def select_pool(self, options: KVSparseOptions | None) -> PoolSpec:
        if options is None or (options.policy is None and options.budget is None):
            return self.pools[0]
        for pool in self.pools:
            s = pool.sparsity
            if options.policy not in (None, s.policy):
                continue
            if options.budget is not None and (not s.compresses or s.budget != options.budget):
                continue
            return pool
        asked = ", ".join(f"{k}={v}" for k, v in options.model_dump(exclude_none=True).items())
        served = "; ".join(
            p.name
            if not p.sparsity.compresses
            else f"{p.sparsity.policy} budget {p.sparsity.budget}"
            for p in self.pools
        )
        raise APIError(
            400,
            f"no engine pool serves kvsparse {asked}; this server runs: {served}",
            param="kvsparse",
            code="unsupported_sparsity",
        )

"""Which layers keep everything, which budget each other layer gets, and which tokens it keeps.

Layers with the same budget form a *layer group*: one KV pool and one block table per sequence.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sparse_core.config import SparsityConfig
from sparse_core.kernels import KernelOps

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class LayerGroup:
    name: str
    layers: tuple[int, ...]
    budget: int | None  # None: the layer keeps every token

    def kept_tokens(self, num_prompt_tokens: int) -> int:
        """Tokens per KV head this group holds right after prefilling a prompt."""
        if self.budget is None:
            return num_prompt_tokens
        return min(num_prompt_tokens, self.budget)


@dataclass(frozen=True)
class LayerPlan:
    groups: tuple[LayerGroup, ...]
    layer_to_group: tuple[int, ...]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, g in enumerate(self.layer_to_group) if self.groups[g].budget is None]


def load_profile(model_name: str) -> dict:
    """The calibrated layer profile shipped for a model (written by `kvsparse calibrate`)."""
    path = PROFILE_DIR / f"{model_name}.json"
    if not path.exists():
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ValueError(
            f"full_layers='auto' needs a calibrated profile for model {model_name!r}, and there is "
            f"none (profiles exist for: {known or 'no model'}); run `kvsparse calibrate` or give "
            f"full_layers as a number or a list of layer indices"
        )
    return json.loads(path.read_text())


def resolve_full_layers(sparsity: SparsityConfig, num_layers: int, model_name: str) -> list[int]:
    spec = sparsity.full_layers
    if spec == "auto":
        spec = load_profile(model_name)["full_layers"]
    if isinstance(spec, int):
        if spec > num_layers:
            raise ValueError(f"full_layers={spec} exceeds the model's {num_layers} layers")
        return list(range(spec))
    out_of_range = [i for i in spec if i >= num_layers]
    if out_of_range:
        raise ValueError(
            f"full_layers {out_of_range} out of range: the model has layers 0..{num_layers - 1}"
        )
    if len(set(spec)) != len(spec):
        raise ValueError(f"full_layers has duplicate layer indices: {spec}")
    return sorted(spec)


def plan_layers(sparsity: SparsityConfig, num_layers: int, model_name: str) -> LayerPlan:
    if not sparsity.compresses:
        return LayerPlan((LayerGroup("full", tuple(range(num_layers)), None),), (0,) * num_layers)
    full = set(resolve_full_layers(sparsity, num_layers, model_name))
    sparse = [i for i in range(num_layers) if i not in full]
    budgets = _sparse_budgets(sparsity, len(sparse))
    layer_budget: dict[int, int | None] = {i: None for i in full}
    layer_budget.update(zip(sparse, budgets, strict=True))
    # One group per distinct budget, full layers first, then budgets from large to small.
    distinct = sorted({b for b in layer_budget.values() if b is not None}, reverse=True)
    keys: list[int | None] = ([None] if full else []) + distinct
    groups = tuple(
        LayerGroup(
            name="full" if b is None else f"budget{b}",
            layers=tuple(i for i in range(num_layers) if layer_budget[i] == b),
            budget=b,
        )
        for b in keys
    )
    layer_to_group = tuple(keys.index(layer_budget[i]) for i in range(num_layers))
    return LayerPlan(groups, layer_to_group)


def _sparse_budgets(sparsity: SparsityConfig, num_sparse: int) -> list[int]:
    """Budget of each sparse layer, shallow to deep."""
    if sparsity.policy != "pyramid" or num_sparse <= 1:
        return [sparsity.budget] * num_sparse
    # Pyramid: budgets fall linearly with depth from 1.5x to 0.5x the mean budget (PyramidKV's
    # shape), then each of `pyramid_tiers` contiguous bands of layers takes its band's mean, so the
    # number of pools stays small. No tier drops below what the window and sinks need.
    floor = sparsity.window + sparsity.sinks + 1
    raw = [sparsity.budget * (1.5 - j / (num_sparse - 1)) for j in range(num_sparse)]
    tiers = min(sparsity.pyramid_tiers, num_sparse)
    bounds = [round(t * num_sparse / tiers) for t in range(tiers + 1)]
    budgets: list[int] = []
    for lo, hi in itertools.pairwise(bounds):
        band = max(floor, round(sum(raw[lo:hi]) / (hi - lo)))
        budgets += [band] * (hi - lo)
    return budgets


def select_kept_tokens(
    sparsity: SparsityConfig,
    budget: int,
    q_win: torch.Tensor,
    k: torch.Tensor,
    lse_win: torch.Tensor | None,
    scale: float,
    ops: KernelOps,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Indices [Hkv, budget] (ascending) of the prompt tokens a layer keeps, per KV head.

    q_win [w, Hq, D]: the window queries; k [n, Hkv, D]: the prompt's keys (RoPE applied);
    lse_win [Hq, w]: the window rows' LSE from the attention kernel, or None to compute it.
    Only called when the prompt is longer than the budget.
    """
    n, num_kv = k.shape[0], k.shape[1]
    window, sinks = sparsity.window, sparsity.sinks
    device = k.device
    if sparsity.policy == "streamingllm":
        recent = torch.arange(n - (budget - sinks), n, device=device)
        kept = torch.cat([torch.arange(sinks, device=device), recent])
        return kept.unsqueeze(0).expand(num_kv, -1).contiguous()
    if sparsity.policy == "random":
        scores = torch.rand(num_kv, n - window, generator=generator, device="cpu").to(device)
        return ops.select_top_tokens(scores, n, budget, window, sinks)
    if lse_win is None:
        lse_win = ops.window_lse(q_win, k, scale)
    scores = ops.window_scores(q_win, k, lse_win, scale, sparsity.gqa_reduce)
    pooled = ops.pool_scores(scores, sparsity.pooling, sparsity.kernel_size)
    return ops.select_top_tokens(pooled, n, budget, window, sinks)

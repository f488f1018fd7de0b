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
from sparse_core.engine.transfers import to_device
from sparse_core.kernels import KernelOps
from sparse_core.kernels.reference import rows_by_head

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


def has_profile(model_name: str) -> bool:
    return (PROFILE_DIR / f"{model_name}.json").exists()


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


@dataclass
class PromptBatch:
    """Prompts packed in a prefill step: host bounds, and the same on the device (built once per
    step, so the layers do no host-to-device copies, which would stall the launch queue; copied
    from page-locked memory, so that a step prepared while the one before it runs does not wait
    for it)."""

    bounds: list[tuple[int, int]]  # [start, end) of each prompt in the packed keys
    starts: torch.Tensor
    lengths: torch.Tensor
    # Where each prompt's window queries end in the packed queries: the ends of `bounds`, unless
    # the step's keys are packed apart from its queries (a prompt's last chunk, whose earlier
    # chunks' keys were gathered from the cache).
    query_ends: list[int]

    @classmethod
    def from_bounds(
        cls,
        bounds: list[tuple[int, int]],
        device: torch.device,
        query_ends: list[int] | None = None,
    ) -> PromptBatch:
        on_device = to_device(bounds, torch.int64, device).view(-1, 2)
        ends = [end for _, end in bounds] if query_ends is None else query_ends
        return cls(bounds, on_device[:, 0], on_device[:, 1] - on_device[:, 0], ends)


def select_kept_tokens(
    sparsity: SparsityConfig,
    budget: int,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor | None,
    prompts: PromptBatch,
    scale: float,
    ops: KernelOps,
    generator: torch.Generator | None = None,
    kv_heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Rows of the packed K/V that a layer keeps, per KV head, for several prompts at once.

    q [T, Hq, D] and k [T', Hkv, D] are a prefill step's packed queries and keys (RoPE applied);
    lse [Hq, T] the attention kernel's row LSE, or None to compute the window rows' LSE here;
    prompts: the prompts to compress (each longer than the budget);
    kv_heads: (first, total) when k holds only some of the model's KV heads (tensor parallelism).
    Returns int64 [Hkv, len(prompts.bounds) * budget]: prompt j's kept rows, ascending, in columns
    [j * budget, (j + 1) * budget). Every step after the scores is batched over the prompts, so
    the launches per layer do not grow with the number of prompts.
    """
    sinks = sparsity.sinks
    bounds, starts, lengths = prompts.bounds, prompts.starts, prompts.lengths
    if sparsity.policy == "streamingllm":
        device = k.device
        recent = budget - sinks
        positions = torch.cat(
            [
                torch.arange(sinks, device=device).expand(len(bounds), -1),
                (lengths - recent).unsqueeze(1) + torch.arange(recent, device=device),
            ],
            dim=1,
        )
        return rows_by_head(positions.unsqueeze(1).expand(-1, k.shape[1], -1), starts)
    scores = [
        _window_scores(sparsity, q, k, lse, b, e, scale, ops, generator, kv_heads)
        for b, e in zip(bounds, prompts.query_ends, strict=True)
    ]
    return ops.select_kept_rows(
        scores,
        lengths - sparsity.window,
        starts,
        budget,
        sparsity.window,
        sinks,
        sparsity.pooling,
        sparsity.kernel_size,
    )


def _window_scores(
    sparsity: SparsityConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor | None,
    bounds: tuple[int, int],
    query_end: int,
    scale: float,
    ops: KernelOps,
    generator: torch.Generator | None,
    kv_heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """[Hkv, n - window] scores of one prompt's non-window tokens: keys k[bounds], window
    queries q[query_end - window : query_end]."""
    start, end = bounds
    window = sparsity.window
    if sparsity.policy == "random":
        # Draw for all of the model's KV heads and keep this rank's: the same draws at any TP size.
        first, total = kv_heads or (0, k.shape[1])
        scores = torch.rand(total, end - start - window, generator=generator)
        return scores[first : first + k.shape[1]].to(k.device)
    q_win, keys = q[query_end - window : query_end], k[start:end]
    lse_win = (
        ops.window_lse(q_win, keys, scale)
        if lse is None
        else lse[:, query_end - window : query_end]
    )
    return ops.window_scores(q_win, keys, lse_win, scale, sparsity.gqa_reduce)

"""Which layers keep everything, and which budget each other layer gets (the layer plan).

Layers with the same budget form a *layer group*: one KV pool and one block table per sequence.
Which tokens a sparse layer keeps is sparse_core/selection.py's; what a group's cache holds of
a sequence over its life, sparse_core/cache/retention.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sparse_core.config import SparsityConfig

# Profiles shipped with kvsparse: PROFILE_DIR / <model>.json (the layers kept whole) and
# PROFILE_DIR / layer_budgets / <model> / <target compression>x.json (per-layer budgets).
PROFILE_DIR = Path(__file__).parent / "profiles"
# A directory of profiles calibrated where the model is served (the Helm chart's calibration
# step writes them into the model cache), laid out as PROFILE_DIR and searched before it.
PROFILE_DIR_ENV = "KVSPARSE_PROFILE_DIR"
# full_layers=None without layer_budgets and no calibrated profile: the first three layers whole
# (the article's shape).
DEFAULT_FULL_LAYERS = 3

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that keep the same share of a prompt: `budget` tokens of every prompt, or a
    `ratio`-th of each (calibrated budgets: the compression asked for at every prompt length),
    or, with neither, all of it. With `decode_window` (decode eviction) the budget bounds what
    the layers ever hold: the prefill keeps the budget less that many tokens, which then hold
    the most recent of the tokens fed after it. With `sliding_window` (the sliding-window
    layers of a model such as Gemma 3) the layers attend to the last that many tokens only, and
    hold no more: the most recent of the prompt, then of every token fed after it."""

    name: str
    layers: tuple[int, ...]
    budget: int | None = None  # tokens per KV head kept of every prompt
    ratio: float | None = None  # keeps ceil(n / ratio) of an n-token prompt, at least `floor`
    floor: int = 0  # fewest tokens a prompt keeps: what the window and sinks need
    decode_window: int | None = None  # decode eviction's recent tokens; None: no eviction
    sliding_window: int | None = None  # the model's attention window of these layers

    @property
    def whole(self) -> bool:
        return self.budget is None and self.ratio is None and self.sliding_window is None

    @property
    def bounded(self) -> bool:
        """Whether the group stops growing during decode (`max_tokens`): decode eviction, or a
        sliding window."""
        return self.decode_window is not None or self.sliding_window is not None

    def budget_tokens(self, num_prompt_tokens: int) -> int | None:
        """The budget for a prompt of this length, in tokens per KV head (None: whole)."""
        if self.ratio is not None:
            return ratio_budget(num_prompt_tokens, self.ratio, self.floor)
        return self.budget if self.sliding_window is None else self.sliding_window

    def max_tokens(self, num_prompt_tokens: int) -> int | None:
        """The most tokens per KV head the group ever holds of a sequence with a prompt of this
        length: its budget with decode eviction, its window if it slides, else None (it grows
        with every token fed)."""
        return self.budget_tokens(num_prompt_tokens) if self.bounded else None

    def kept_tokens(self, num_prompt_tokens: int) -> int:
        """Tokens per KV head this group holds right after prefilling a prompt."""
        n = num_prompt_tokens
        budget = self.budget_tokens(n)
        if budget is None:
            return n
        if self.decode_window is not None:
            # The ring takes at least one token (else the group would grow), the prompt at
            # least `floor` less one: the window and the sinks.
            budget -= max(min(self.decode_window, budget - self.floor), 1)
        return min(n, budget)

    def at_length(self, num_prompt_tokens: int) -> LayerGroup:
        """The group with a ratio fixed into the budget it gives a prompt of this length (for
        vLLM's plugin, whose KV cache specs take a fixed budget)."""
        if self.ratio is None:
            return self
        budget = self.kept_tokens(num_prompt_tokens)
        return LayerGroup(f"budget{budget}", self.layers, budget)


@dataclass(frozen=True)
class LayerPlan:
    groups: tuple[LayerGroup, ...]
    layer_to_group: tuple[int, ...]
    # Where the layers kept whole came from: "calibrated" (a calibrated profile), "default"
    # (no profile for the model: the first 3), "configured" (given) or "none" (dense).
    source: str = "configured"

    @property
    def full_layers(self) -> list[int]:
        return [i for i, g in enumerate(self.layer_to_group) if self.groups[g].whole]

    @property
    def compresses(self) -> bool:
        return not all(g.whole for g in self.groups)

    def token_layers(self, tokens: Mapping[str, int]) -> int:
        """Token-layers held when every group's layers hold `tokens[group name]` tokens each."""
        return sum(len(g.layers) * tokens[g.name] for g in self.groups)

    def at_length(self, num_prompt_tokens: int) -> LayerPlan:
        """The plan with every ratio fixed into the budget it gives a prompt of this length."""
        groups = tuple(g.at_length(num_prompt_tokens) for g in self.groups)
        return dataclasses.replace(self, groups=groups)


def profile_dirs() -> list[Path]:
    """Where profiles are looked up, first match wins: $KVSPARSE_PROFILE_DIR, then the shipped
    ones."""
    local = os.environ.get(PROFILE_DIR_ENV)
    return [Path(local), PROFILE_DIR] if local else [PROFILE_DIR]


def profile_path(model_name: str) -> Path | None:
    """The calibrated full-layer profile of a model, if one exists."""
    found = (d / f"{model_name}.json" for d in profile_dirs())
    return next((p for p in found if p.exists()), None)


def new_profile_path(model_name: str) -> Path:
    """Where `kvsparse calibrate` writes a model's profile: $KVSPARSE_PROFILE_DIR when set."""
    return profile_dirs()[0] / f"{model_name}.json"


def load_profile(model_name: str) -> dict:
    """The calibrated layer profile of a model (written by `kvsparse calibrate`)."""
    path = profile_path(model_name)
    if path is None:
        known = sorted(p.stem for d in profile_dirs() for p in d.glob("*.json"))
        raise ValueError(
            f"full_layers='auto' needs a calibrated profile for model {model_name!r}, and there is "
            f"none (profiles exist for: {known or 'no model'}); run `kvsparse calibrate` or give "
            f"full_layers as a number or a list of layer indices"
        )
    return json.loads(path.read_text())


@dataclass(frozen=True)
class BudgetProfile:
    """A model's calibrated per-layer budgets for one effective compression (written by
    `kvsparse calibrate --target-compression`). Budgets are relative to the prompt, so one
    profile serves every prompt length: layer i keeps prompt_len / layer_ratios[i] tokens, or
    all of them where that is None."""

    model: str
    target_compression: float
    layer_ratios: tuple[float | None, ...]
    path: Path

    @classmethod
    def load(cls, path: Path) -> BudgetProfile:
        data = json.loads(path.read_text())
        return cls(
            data["model"], float(data["target_compression"]), tuple(data["layer_ratios"]), path
        )


def budgets_for_ratios(
    ratios: tuple[float | None, ...] | list[float | None], prompt_len: int, floor: int
) -> list[int | None]:
    """Token budgets of layers that keep a ratio-th of a prompt_len-token prompt (None: whole),
    none below `floor` (what the window and sinks need)."""
    return [None if r is None else ratio_budget(prompt_len, r, floor) for r in ratios]


def ratio_budget(prompt_len: int, ratio: float, floor: int) -> int:
    """Tokens a layer of this ratio keeps of a prompt: a ratio-th, rounded up, at least
    `floor`."""
    return max(floor, math.ceil(prompt_len / ratio))


def ratios_compression(ratios: tuple[float | None, ...] | list[float | None]) -> float:
    """Effective compression over all layers of per-layer ratios (None: whole)."""
    return len(ratios) / sum(1.0 if r is None else 1.0 / r for r in ratios)


def budget_profile_dirs(model_name: str) -> list[Path]:
    """Where a model's per-layer budget profiles are looked up (profile_dirs)."""
    return [d / "layer_budgets" / model_name for d in profile_dirs()]


def budget_profiles(model_name: str) -> list[BudgetProfile]:
    """A model's per-layer budget profiles, by target compression, from the first directory
    that has any."""
    for directory in budget_profile_dirs(model_name):
        paths = sorted(directory.glob("*.json"))
        if paths:
            return sorted(
                (BudgetProfile.load(p) for p in paths), key=lambda p: p.target_compression
            )
    return []


def nearest_budget_profile(model_name: str, target_compression: float) -> BudgetProfile:
    profiles = budget_profiles(model_name)
    if not profiles:
        known = sorted(
            {p.parent.name for d in profile_dirs() for p in d.glob("layer_budgets/*/*.json")}
        )
        raise ValueError(
            f"layer_budgets='auto' needs per-layer budget profiles for model {model_name!r}, and "
            f"there are none (profiles exist for: {known or 'no model'}); run `kvsparse "
            f"calibrate --target-compression R` or give layer_budgets as a list"
        )
    best = min(profiles, key=lambda p: abs(p.target_compression - target_compression))
    logger.info(
        "layer_budgets='auto' at target_compression %g: %s's profile calibrated for %gx (%s)",
        target_compression,
        model_name,
        best.target_compression,
        best.path.name,
    )
    return best


# What one layer keeps: (budget, ratio) as in LayerGroup; (None, None) keeps it whole.
LayerKeep = tuple[int | None, float | None]


def layer_keeps(sparsity: SparsityConfig, num_layers: int, model_name: str) -> list[LayerKeep]:
    """What every layer keeps, from whichever of full_layers + budget (+ pyramid) or
    layer_budgets the config uses; layer_budgets="auto" keeps the calibrated ratios."""
    spec = sparsity.layer_budgets
    if spec == "auto":
        assert sparsity.target_compression is not None  # SparsityConfig checks it
        ratios = nearest_budget_profile(model_name, sparsity.target_compression).layer_ratios
        if len(ratios) != num_layers:
            raise ValueError(
                f"{model_name}'s budget profile has {len(ratios)} layers; the model has "
                f"{num_layers}: calibrate it again (`kvsparse calibrate --target-compression`)"
            )
        return [(None, None if r is None else float(r)) for r in ratios]
    if spec is not None:
        if len(spec) != num_layers:
            raise ValueError(
                f"layer_budgets has {len(spec)} entries; the model has {num_layers} layers (one "
                f"entry per layer, None for a whole layer)"
            )
        return [(b, None) for b in spec]
    full = set(resolve_full_layers(sparsity, num_layers, model_name))
    sparse = [i for i in range(num_layers) if i not in full]
    by_layer: dict[int, LayerKeep] = {i: (None, None) for i in full}
    by_layer.update(
        (i, (b, None)) for i, b in zip(sparse, _sparse_budgets(sparsity, len(sparse)), strict=True)
    )
    return [by_layer[i] for i in range(num_layers)]


def with_full_layers_given(sparsity: SparsityConfig, model_name: str) -> tuple[SparsityConfig, str]:
    """`sparsity` with an unset full_layers (and no layer_budgets) made explicit: the model's
    calibrated profile where one exists, else the first DEFAULT_FULL_LAYERS (logged, since
    calibrating finds better ones); and where the layers kept whole come from (LayerPlan.source).
    """
    given = sparsity.layer_budgets if sparsity.layer_budgets is not None else sparsity.full_layers
    if given is not None:
        return sparsity, "calibrated" if given == "auto" else "configured"
    path = profile_path(model_name)
    if path is None:
        logger.warning(
            "%s has no calibrated layer profile: the first %d layers kept whole (the article's "
            "shape); `kvsparse calibrate --model %s` finds the layers it needs whole "
            "(docs/accuracy.md)",
            model_name,
            DEFAULT_FULL_LAYERS,
            model_name,
        )
        return dataclasses.replace(sparsity, full_layers=DEFAULT_FULL_LAYERS), "default"
    logger.info("%s: the layers kept whole from its calibrated profile %s", model_name, path)
    return dataclasses.replace(sparsity, full_layers="auto"), "calibrated"


def resolve_full_layers(sparsity: SparsityConfig, num_layers: int, model_name: str) -> list[int]:
    """The layers kept whole (unset: see with_full_layers_given)."""
    spec = with_full_layers_given(sparsity, model_name)[0].full_layers
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


@dataclass(frozen=True)
class SlidingLayers:
    """A model's sliding-window layers (Gemma 3's local layers): each attends to the last
    `window` tokens only, so it keeps that many whatever the sparsity config; sparsity, the
    layers kept whole and calibration are over the model's other layers."""

    window: int
    layers: tuple[int, ...]


def plan_layers(
    sparsity: SparsityConfig,
    num_layers: int,
    model_name: str,
    sliding: SlidingLayers | None = None,
) -> LayerPlan:
    """Layer groups of a model under a sparsity config. With sliding-window layers they form a
    group of their own, and the config's layer indices (full_layers, layer_budgets, profiles)
    count the other layers only: index i is the i-th of them."""
    sliding_layers = set(sliding.layers) if sliding is not None else set()
    scored = [i for i in range(num_layers) if i not in sliding_layers]
    groups, layer_to_group, source = _plan_scored(sparsity, len(scored), model_name)
    to_group = [0] * num_layers
    for i, g in zip(scored, layer_to_group, strict=True):
        to_group[i] = g
    groups = tuple(
        dataclasses.replace(g, layers=tuple(scored[i] for i in g.layers)) for g in groups
    )
    if sliding is not None and sliding.layers:
        for i in sliding.layers:
            to_group[i] = len(groups)
        window = LayerGroup(
            f"sliding{sliding.window}", tuple(sorted(sliding_layers)),
            sliding_window=sliding.window,
        )  # fmt: skip
        groups = (*groups, window)
    return LayerPlan(groups, tuple(to_group), source)


def _plan_scored(
    sparsity: SparsityConfig, num_layers: int, model_name: str
) -> tuple[tuple[LayerGroup, ...], tuple[int, ...], str]:
    """The groups of `num_layers` layers that attend to the whole context, numbered from 0."""
    if not sparsity.compresses:
        return (LayerGroup("full", tuple(range(num_layers))),), (0,) * num_layers, "none"
    sparsity, source = with_full_layers_given(sparsity, model_name)
    keeps = layer_keeps(sparsity, num_layers, model_name)
    # One group per distinct keep: whole layers first, then from the most kept to the least.
    keys = sorted(set(keeps), key=_most_kept_first)
    floor = sparsity.window + sparsity.sinks + 1
    decode_window = sparsity.decode_window if sparsity.decode_eviction else None
    groups = tuple(
        LayerGroup(
            name=_group_name(budget, ratio),
            layers=tuple(i for i in range(num_layers) if keeps[i] == (budget, ratio)),
            budget=budget,
            ratio=ratio,
            floor=0 if budget is None and ratio is None else floor,
            decode_window=decode_window if budget is not None or ratio is not None else None,
        )
        for budget, ratio in keys
    )
    return groups, tuple(keys.index(k) for k in keeps), source


def _most_kept_first(keep: LayerKeep) -> tuple[int, float]:
    budget, ratio = keep
    if budget is None and ratio is None:
        return (0, 0.0)
    return (1, -budget) if budget is not None else (2, ratio)


def _group_name(budget: int | None, ratio: float | None) -> str:
    if ratio is not None:
        return f"ratio{ratio:g}"
    return "full" if budget is None else f"budget{budget}"


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

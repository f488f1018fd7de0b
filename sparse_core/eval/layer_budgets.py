"""Per-layer budget calibration: a budget for every layer that meets an effective compression R
over all layers and loses the least on the model's probes.

1. Sensitivity. For each band of `band_size` consecutive layers and each level r of `levels`,
   the probes run with only that band compressed, keeping length / r tokens (every other layer
   whole). The band's damage at r is the divergence from dense: the share of dense's answer,
   from its start to the end of the last expected answer it contains, that the run no longer
   reproduces (points, 0-100), over the probes that dense answers; made non-decreasing in r
   (keeping fewer tokens never helps).
2. Allocation. Every band stays whole or takes one level, minimising the summed damage under
   the memory that compression R leaves (kept fractions summed over layers <= L / R): a
   multiple-choice knapsack, solved exactly by dynamic programming in units of 1 / lcm(levels).
   A tiny cost per halving of a band's budget breaks ties (bands where nothing was measured)
   towards spreading compression evenly and using the whole allowance.

Why divergence rather than accuracy: with a dozen probes accuracy moves in steps of 8 points or
more, and one band compressed alone rarely flips an answer; divergence moves by one character
of the answer, so it ranks bands that accuracy ties. Why only up to the answer, and only where
dense answers: the text dense writes after its answer, or instead of one, has nothing to lose,
and any change of the logits rewrites it; counted, it gave every layer a damage of 5-17 points
whatever its budget (docs/layer_budgets.md). Why sums of single-band damage: measuring
bands together needs a run per combination; the sum is the first-order estimate, and the
comparison the calibration runs afterwards checks the allocation as a whole.

3. Refinement (optional, `kvsparse calibrate --refine`). Measured from dense, most layers of
   SmolLM2 lose nothing compressed alone, yet compressed together they lose 10 points: the sum
   of single-band damages is blind to what layers lose together. So each target's allocation
   becomes an operating point, and every band is measured again there: each other option
   (whole, or another level) with the rest at the operating point, its damage the change of
   divergence from dense's answers against the operating point itself (negative where the band
   gives answers back), clamped so that keeping more never costs and keeping less never gives
   back. The same knapsack then re-allocates by these changes: a first-order step around where
   the profile will run instead of around dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparse_core.eval.calibrate import bands, span
from sparse_core.eval.runner import EvalConfig, SampleResult
from sparse_core.policy import ratios_compression

TIE_BREAK = 1e-3  # damage points per halving of one layer's budget


@dataclass
class BandDamage:
    layers: list[int]
    # Option (a level r: the band keeps length / r tokens; None: whole) -> points of dense's
    # answers lost against a reference: every layer whole for the sensitivity measurement (where
    # whole is 0 and left out), the operating point for a refinement (where the band's own
    # option there is 0).
    damage: dict[int | None, float]


def probe_configs(num_layers: int, band_size: int, levels: list[int]) -> list[EvalConfig]:
    """Dense, then every band alone at every level (the rest whole)."""
    configs = [EvalConfig("dense")]
    for band in bands(num_layers, band_size):
        for r in levels:
            ratios = tuple(r if i in band else None for i in range(num_layers))
            configs.append(_levels_config(ratios, _probe_label(band, r)))
    return configs


ProbeKey = tuple[str, int, int]  # task, length, index


def measure(
    results: list[SampleResult],
    answers: dict[ProbeKey, list[str]],
    num_layers: int,
    band_size: int,
    levels: list[int],
) -> list[BandDamage]:
    """Each band's damage at each level, from the results of `probe_configs` and each probe's
    expected answers."""
    points = _divergence_points(results, answers)
    out = []
    for band in bands(num_layers, band_size):
        damage: dict[int | None, float] = {}
        worst = 0.0
        for r in sorted(levels):
            worst = max(worst, points.get(_probe_label(band, r), 0.0))
            damage[r] = worst
        out.append(BandDamage(band, damage))
    return out


def refine_configs(
    base: tuple[int | None, ...], band_size: int, levels: list[int], tag: str
) -> list[EvalConfig]:
    """The operating point `base` (per-layer levels, None: whole), then every band at each of
    its other options (whole or a level) with the other layers at `base`. `tag` names the
    operating point in the labels (one run can hold several)."""
    configs = [_levels_config(base, f"{tag}: operating point")]
    for band in bands(len(base), band_size):
        for option in (None, *levels):
            if any(base[i] != option for i in band):
                ratios = tuple(option if i in band else r for i, r in enumerate(base))
                configs.append(_levels_config(ratios, _refine_label(tag, band, option)))
    return configs


def measure_around(
    results: list[SampleResult],
    answers: dict[ProbeKey, list[str]],
    base: tuple[int | None, ...],
    band_size: int,
    levels: list[int],
    tag: str,
) -> tuple[list[BandDamage], float]:
    """Each band's change of damage moving alone from the operating point to each option, from
    the results of `refine_configs` (and dense's). Keeping more tokens than at the operating
    point never costs and keeping fewer never gives back: from the band's own option (0) the
    changes are made non-increasing towards whole and non-decreasing towards the highest level
    (a band of mixed levels has no own option: non-decreasing from whole). Returns them and the
    damage at the operating point."""
    points = _divergence_points(results, answers)
    at_base = points.get(f"{tag}: operating point", 0.0)
    options: list[int | None] = [None, *sorted(levels)]
    out = []
    for band in bands(len(base), band_size):
        raw = [
            0.0
            if all(base[i] == option for i in band)
            else points.get(_refine_label(tag, band, option), at_base) - at_base
            for option in options
        ]
        own = {base[i] for i in band}
        start = options.index(own.pop()) if len(own) == 1 else 0
        change = raw[:]
        for k in range(start + 1, len(options)):  # less kept: never gives back
            change[k] = max(change[k], change[k - 1])
        for k in range(start - 1, -1, -1):  # more kept: never costs
            change[k] = min(change[k], change[k + 1])
        out.append(BandDamage(band, dict(zip(options, change, strict=True))))
    return out, at_base


def _divergence_points(
    results: list[SampleResult], answers: dict[ProbeKey, list[str]]
) -> dict[str, float]:
    """Per config, the mean divergence (points) from dense's answer over the probes that dense
    answers; configs with no such probe are left out."""
    references = {}
    for r in results:
        if r.config == "dense":
            key = (r.task, r.length, r.index)
            reference = answer_part(r.output, answers[key])
            if reference:
                references[key] = reference
    by_config: dict[str, list[float]] = {}
    for r in results:
        reference = references.get((r.task, r.length, r.index))
        if r.config != "dense" and reference:
            by_config.setdefault(r.config, []).append(divergence(reference, r.output))
    return {config: 100 * sum(v) / len(v) for config, v in by_config.items()}


def answer_part(output: str, answers: list[str]) -> str:
    """`output` up to the end of the last of `answers` it contains (compared as `score` does,
    ignoring case); empty when it contains none."""
    text = output.lower()
    ends = [text.find(a.lower()) + len(a) for a in answers if a.lower() in text]
    return output[: max(ends)] if ends else ""


def divergence(reference: str, output: str) -> float:
    """Share of `reference` (dense's text), from its start, that `output` does not reproduce."""
    if not reference:
        return 0.0
    same = 0
    for a, b in zip(reference, output, strict=False):
        if a != b:
            break
        same += 1
    return 1 - same / len(reference)


def allocate(
    damages: list[BandDamage], num_layers: int, target: float
) -> tuple[tuple[int | None, ...], float]:
    """Per-layer levels (None: whole) meeting compression `target` with the least summed damage;
    returns them and that damage."""
    levels = sorted({r for b in damages for r in b.damage if r is not None})
    unit = math.lcm(*levels)
    capacity = math.floor(num_layers * unit / target + 1e-9)
    # best[c]: (damage, choices) of the bands so far, keeping c units of kept fractions
    best: dict[int, tuple[float, list[int | None]]] = {0: (0.0, [])}
    for band in damages:
        size = len(band.layers)
        options: list[tuple[int | None, int, float]] = [
            (None, size * unit, band.damage.get(None, 0.0))
        ]
        options += [
            (r, size * unit // r, d + TIE_BREAK * size * math.log2(r))
            for r, d in band.damage.items()
            if r is not None
        ]
        nxt: dict[int, tuple[float, list[int | None]]] = {}
        for used, (damage, choices) in best.items():
            for level, cost, d in options:
                c = used + cost
                if c <= capacity and (c not in nxt or damage + d < nxt[c][0]):
                    nxt[c] = (damage + d, [*choices, level])
        best = nxt
        if not best:
            most = num_layers / sum(len(b.layers) / levels[-1] for b in damages)
            raise ValueError(
                f"target compression {target:g}x is beyond levels {levels}: compressing every "
                f"layer at the highest level gives {most:.2f}x; add a higher level"
            )
    damage, choices = min(best.values(), key=lambda v: v[0])
    per_layer: list[int | None] = [None] * num_layers
    for band, level in zip(damages, choices, strict=True):
        for i in band.layers:
            per_layer[i] = level
    measured = sum(b.damage.get(lv, 0.0) for b, lv in zip(damages, choices, strict=True))
    return tuple(per_layer), measured


def comparison_configs(
    ratios: list[float],
    full_layers: list[int],
    num_layers: int,
    budgets: dict[float, tuple[int | None, ...]] | None = None,
) -> list[EvalConfig]:
    """Calibrated per-layer budgets beside the other ways to reach each effective compression:
    uniform SnapKV, the binary profile (calibrated full layers, where it can reach the ratio),
    PyramidKV, StreamingLLM, and random selection on the calibrated budgets (selection check).
    `budgets`: per ratio, per-layer levels to use instead of the shipped profile ("auto")."""
    configs = [EvalConfig("dense")]
    for r in ratios:
        spec = (budgets or {}).get(r, "auto")
        configs += [
            EvalConfig("snapkv", r, layer_budgets=spec, label=f"budgets@{r:g}x"),
            EvalConfig("snapkv", r, 0, label=f"uniform@{r:g}x"),
        ]
        if len(full_layers) < num_layers / r:
            configs.append(
                EvalConfig("snapkv", r, full_layers, match_effective=True, label=f"binary@{r:g}x")
            )
        configs += [
            EvalConfig("pyramid", r, 0, label=f"pyramid@{r:g}x"),
            EvalConfig("streamingllm", r, 0, label=f"streamingllm@{r:g}x"),
            EvalConfig("random", r, layer_budgets=spec, label=f"random-budgets@{r:g}x"),
        ]
    return configs


def _probe_label(band: list[int], level: int) -> str:
    return f"{span(band)} at {level}x"


def _refine_label(tag: str, band: list[int], option: int | None) -> str:
    return f"{tag}: {span(band)} {'whole' if option is None else f'at {option}x'}"


def _levels_config(ratios: tuple[int | None, ...], label: str) -> EvalConfig:
    return EvalConfig("snapkv", ratios_compression(ratios), layer_budgets=ratios, label=label)

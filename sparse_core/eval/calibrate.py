"""Layer-sensitivity calibration: which layers must stay whole for the answers to survive.

For each band of consecutive layers, two measurements on the suite (snapkv at `ratio`):
- damage: accuracy lost when only that band is compressed (every other layer whole);
- rescue: accuracy regained when only that band is kept whole (every other layer compressed).
A band's sensitivity is damage + rescue; the profile keeps whole the most sensitive bands until
`num_full` layers are chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_core.eval.runner import EvalConfig, RunSettings, SampleResult, run_suite
from sparse_core.eval.tasks import Sample
from sparse_core.models.loader import ModelSource
from sparse_core.plotting import pyplot, save


@dataclass
class BandSensitivity:
    layers: list[int]
    damage: float  # points lost, compressing only this band
    rescue: float  # points regained, keeping only this band whole

    @property
    def sensitivity(self) -> float:
        return self.damage + self.rescue


def bands(num_layers: int, band_size: int) -> list[list[int]]:
    return [list(range(i, min(i + band_size, num_layers))) for i in range(0, num_layers, band_size)]


def band_configs(num_layers: int, band_size: int, ratio: float) -> list[EvalConfig]:
    configs = [EvalConfig("dense"), EvalConfig("snapkv", ratio, 0, label="all-compressed")]
    for band in bands(num_layers, band_size):
        rest = [i for i in range(num_layers) if i not in band]
        configs.append(EvalConfig("snapkv", ratio, rest, label=f"compress {span(band)}"))
        configs.append(EvalConfig("snapkv", ratio, band, label=f"keep {span(band)}"))
    return configs


def measure(
    samples: list[Sample],
    settings: RunSettings,
    num_layers: int,
    band_size: int,
    ratio: float,
    source: ModelSource | None = None,
) -> tuple[list[BandSensitivity], list[SampleResult]]:
    configs = band_configs(num_layers, band_size, ratio)
    results = run_suite(configs, samples, settings, source=source)
    acc = _accuracy(results)
    dense, floor = acc["dense"], acc["all-compressed"]
    out = [
        BandSensitivity(
            layers=band,
            damage=dense - acc[f"compress {span(band)}"],
            rescue=acc[f"keep {span(band)}"] - floor,
        )
        for band in bands(num_layers, band_size)
    ]
    return out, results


def choose_full_layers(sensitivities: list[BandSensitivity], num_full: int) -> list[int]:
    chosen: list[int] = []
    for band in sorted(sensitivities, key=lambda b: -b.sensitivity):
        if len(chosen) >= num_full:
            break
        chosen += band.layers[: num_full - len(chosen)]
    return sorted(chosen)


def comparison_configs(full_layers: list[int], ratios: list[float]) -> list[EvalConfig]:
    """Uniform, first-3-full and calibrated snapkv at the same effective compression."""
    configs = [EvalConfig("dense")]
    for r in ratios:
        configs += [
            EvalConfig("snapkv", r, 0, label=f"uniform@{r:g}x"),
            EvalConfig("snapkv", r, 3, match_effective=True, label=f"first-3@{r:g}x"),
            EvalConfig("snapkv", r, full_layers, match_effective=True, label=f"calibrated@{r:g}x"),
            EvalConfig("random", r, full_layers, match_effective=True, label=f"random-cal@{r:g}x"),
        ]
    return configs


def _accuracy(results: list[SampleResult]) -> dict[str, float]:
    totals: dict[str, list[float]] = {}
    for r in results:
        totals.setdefault(r.config, []).append(r.score)
    return {k: 100 * sum(v) / len(v) for k, v in totals.items()}


def span(layers: list[int]) -> str:
    return f"L{layers[0]}" if len(layers) == 1 else f"L{layers[0]}-{layers[-1]}"


def plot_sensitivity(sensitivities: list[BandSensitivity], path: str, title: str) -> None:
    plt = pyplot()
    names = [span(b.layers) for b in sensitivities]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], [b.damage for b in sensitivities], 0.4, label="damage")
    ax.bar([i + 0.2 for i in x], [b.rescue for b in sensitivities], 0.4, label="rescue")
    ax.set_xticks(list(x), names, rotation=45)
    ax.set_ylabel("accuracy points")
    ax.set_title(title)
    ax.legend()
    save(fig, path, dpi=120)

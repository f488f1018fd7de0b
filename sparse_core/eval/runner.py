"""Run the suite: every (policy, compression) configuration over the same samples, through `LLM`,
in one or both query settings:
- query-aware: the whole prompt is prefilled, so the question sits in the observation window;
- query-agnostic: only the context is prefilled and compressed (window = its last tokens), then
  the question is fed over the compressed cache (`SamplingParams.compress_prefix_len`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.eval.tasks import Sample, score
from sparse_core.models.loader import ModelSource, load_model_source
from sparse_core.policy import budgets_for_ratios, resolve_full_layers

QUERY_AWARE, QUERY_AGNOSTIC = "query-aware", "query-agnostic"
QUERY_SETTINGS = (QUERY_AWARE, QUERY_AGNOSTIC)


@dataclass(frozen=True)
class EvalConfig:
    """One row of the table: a policy at a nominal compression of the prompt.

    ratio: nominal compression (prompt length / budget of a sparse layer); None for dense.
    full_layers: layers kept whole; with `match_effective`, the budget of the other layers is
    chosen so that the compression over ALL layers equals `ratio` (for comparing layer profiles
    at equal memory), otherwise budget = length / ratio.
    layer_budgets: instead of full_layers and one budget, a budget per layer: "auto" (the
    model's shipped profile nearest `ratio`, sized for the prompt length), or per-layer ratios
    (layer i keeps length / ratio tokens; None keeps it whole).
    """

    policy: str
    ratio: float | None = None
    full_layers: int | list[int] | str = 0
    match_effective: bool = False
    label: str = ""
    layer_budgets: str | tuple[float | None, ...] | None = None

    @property
    def name(self) -> str:
        return self.label or (
            self.policy if self.ratio is None else f"{self.policy}@{self.ratio:g}x"
        )

    def budget(self, length: int, num_layers: int, num_full: int) -> int | None:
        if self.ratio is None:
            return None
        if not self.match_effective:
            return max(1, round(length / self.ratio))
        # kept token-layers = num_full * n + (L - num_full) * B = L * n / ratio
        sparse = num_layers - num_full
        return max(1, round(length * (num_layers / self.ratio - num_full) / sparse))

    def sparsity(
        self, length: int, num_layers: int, model_name: str, window: int, sinks: int
    ) -> SparsityConfig:
        """The engine's sparsity for prompts of `length` tokens."""
        if self.ratio is None:
            return SparsityConfig(policy="dense")
        if self.layer_budgets is not None:
            per_layer: str | list[int | None] = (
                "auto"
                if self.layer_budgets == "auto"
                else budgets_for_ratios(self.layer_budgets, length, window + sinks + 1)
            )
            return SparsityConfig(
                policy=self.policy,
                window=window,
                sinks=sinks,
                layer_budgets=per_layer,
                target_compression=self.ratio if per_layer == "auto" else None,
            )
        budget = self.budget(length, num_layers, num_full_layers(self, num_layers, model_name))
        full = list(self.full_layers) if isinstance(self.full_layers, tuple) else self.full_layers
        return SparsityConfig(
            policy=self.policy, budget=budget, window=window, sinks=sinks, full_layers=full
        )


@dataclass
class SampleResult:
    config: str
    task: str
    length: int
    index: int
    depth: float | None
    prompt_tokens: int
    score: float
    compression: float  # effective: prompt token-layers / kept token-layers, over all layers
    output: str
    setting: str = QUERY_AWARE


@dataclass
class RunSettings:
    model: str = "smollm2-135m-instruct"
    window: int = 32
    sinks: int = 4
    max_num_seqs: int = 32
    kv_cache_memory_gb: float = 4.0
    device: str | None = None
    dtype: str | None = None
    query_settings: tuple[str, ...] = (QUERY_AWARE,)
    engine_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.query_settings) - set(QUERY_SETTINGS)
        if unknown or not self.query_settings:
            raise ValueError(
                f"query settings must be among {QUERY_SETTINGS}, got {self.query_settings}"
            )


def num_full_layers(config: EvalConfig, num_layers: int, model_name: str) -> int:
    if config.ratio is None:
        return num_layers
    probe = SparsityConfig(policy=config.policy, budget=10**6, full_layers=config.full_layers)
    return len(resolve_full_layers(probe, num_layers, model_name))


def run_config(
    config: EvalConfig,
    samples: list[Sample],
    settings: RunSettings,
    source: ModelSource,
    bar: tqdm | None = None,
) -> list[SampleResult]:
    """All samples under one configuration, in every query setting: one engine per prompt length
    (budgets scale with it), both settings' requests in the same batch."""
    results: list[SampleResult] = []
    by_length: dict[int, list[Sample]] = {}
    for s in samples:
        by_length.setdefault(s.length, []).append(s)
    lengths = sorted(by_length) if config.ratio is not None else [max(by_length)]
    for length in lengths:
        group = by_length[length] if config.ratio is not None else samples
        llm = _make_llm(config, length, settings, source)
        jobs = [(s, setting) for setting in settings.query_settings for s in group]
        params = [
            SamplingParams(
                max_tokens=s.max_tokens,
                temperature=0.0,
                compress_prefix_len=s.context_len if setting == QUERY_AGNOSTIC else None,
            )
            for s, setting in jobs
        ]
        outs = llm.generate([s.prompt_ids for s, _ in jobs], params)
        for (s, setting), out in zip(jobs, outs, strict=True):
            results.append(
                SampleResult(
                    config=config.name,
                    setting=setting,
                    task=s.task,
                    length=s.length,
                    index=s.index,
                    depth=s.depth,
                    prompt_tokens=len(s.prompt_ids),
                    score=score(s, out.text),
                    compression=out.compression_ratio,
                    output=out.text,
                )
            )
        del llm  # free its KV cache before the next length's engine allocates one
        if bar is not None:
            bar.update(len(jobs))
    return results


def _make_llm(config: EvalConfig, length: int, settings: RunSettings, source: ModelSource) -> LLM:
    num_layers, name = source.config.num_scored_layers, source.config.name
    sparsity = config.sparsity(length, num_layers, name, settings.window, settings.sinks)
    return LLM(
        model=settings.model,
        sparsity=sparsity,
        # Loaded once for the whole sweep: dequantising costs more than building an engine.
        model_source=source,
        max_model_len=min(length + 64, source.config.max_position_embeddings),
        expected_input_len=length,
        max_num_seqs=settings.max_num_seqs,
        kv_cache_memory_gb=settings.kv_cache_memory_gb,
        device=settings.device,
        dtype=settings.dtype,
        enforce_eager=True,  # each engine would capture its own graphs, for a short run
        **settings.engine_args,
    )


def run_suite(
    configs: list[EvalConfig],
    samples: list[Sample],
    settings: RunSettings,
    progress: bool = True,
    source: ModelSource | None = None,
) -> list[SampleResult]:
    """`source`: the model already loaded (the one `settings.model` names)."""
    results: list[SampleResult] = []
    source = source or load_model_source(settings.model)
    total = len(configs) * len(samples) * len(settings.query_settings)
    with tqdm(total=total, desc="eval", disable=not progress) as bar:
        for config in configs:
            start = time.monotonic()
            results += run_config(config, samples, settings, source, bar)
            bar.set_postfix_str(f"{config.name} {time.monotonic() - start:.0f}s")
    return results


def as_dicts(results: list[SampleResult]) -> list[dict]:
    return [asdict(r) for r in results]

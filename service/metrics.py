"""Serving metrics (Prometheus names, base units): vLLM's name, type, labels and buckets
(`vllm:`) for every metric vLLM has, so that vLLM's Grafana dashboards and autoscalers (KEDA on
`vllm:num_requests_waiting`) work as they are; the `kvsparse_` prefix for what vLLM has no name
for (per-group KV blocks, the compression ratio, the engine's peak GPU memory, failed requests).

The same definitions go to one of two sinks: prometheus_client (standalone: the server's own
`/metrics`) or `ray.util.metrics` (Ray mode: each node's metrics export port, which is what
KubeRay's monitors scrape). Ray prefixes every name there with `ray_` and takes no `:`, so
`vllm:x` is exported as `ray_vllm_x`; the Helm chart's PrometheusRule records each under its
standalone name again (`RAY_NAMES`), so dashboards and alerts read one set of names in both
modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparse_core.engine.llm_engine import EngineStats
    from sparse_core.policy import LayerPlan

# Buckets follow vLLM's, so dashboards and alerts carry over.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]  # fmt: skip
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
COMPRESSION_BUCKETS = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0]


@dataclass(frozen=True)
class MetricDef:
    kind: str  # counter | gauge | histogram
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


DEFINITIONS = [
    MetricDef("histogram", "vllm:time_to_first_token_seconds",
              "Time from request arrival to its first generated token.",
              buckets=tuple(TTFT_BUCKETS)),
    MetricDef("histogram", "vllm:inter_token_latency_seconds",
              "Time between consecutive generated tokens of a request.",
              buckets=tuple(ITL_BUCKETS)),
    MetricDef("histogram", "vllm:request_time_per_output_token_seconds",
              "Per request: time from its first token to its last over its tokens after the first.",
              buckets=tuple(ITL_BUCKETS)),
    MetricDef("histogram", "vllm:e2e_request_latency_seconds",
              "Time from request arrival to its last token.", buckets=tuple(E2E_BUCKETS)),
    MetricDef("counter", "vllm:prompt_tokens_total", "Prompt tokens prefilled."),
    MetricDef("counter", "vllm:generation_tokens_total", "Generated tokens."),
    MetricDef("gauge", "vllm:num_requests_running", "Requests in the running batch."),
    MetricDef("gauge", "vllm:num_requests_waiting", "Requests waiting for KV memory or a slot."),
    MetricDef("gauge", "vllm:kv_cache_usage_perc",
              "KV cache usage, 1 = full: the blocks in use, of the pool every layer group "
              "shares."),
    MetricDef("counter", "vllm:num_preemptions_total",
              "Sequences preempted for lack of KV memory (recomputed later)."),
    MetricDef("counter", "vllm:request_success_total",
              "Requests finished, by reason: stop, length, abort (the client went away).",
              labels=("finished_reason",)),
    MetricDef("counter", "vllm:prefix_cache_queries_total",
              "Prefill tokens looked up in the prefix cache."),
    MetricDef("counter", "vllm:prefix_cache_hits_total",
              "Prefill tokens found in the prefix cache."),
    MetricDef("counter", "kvsparse_request_errors_total",
              "Requests that failed on the server's side (answered 5xx): the engine failed or "
              "stopped. Requests refused as invalid (4xx) are the client's errors, not counted."),
    MetricDef("gauge", "kvsparse_kv_blocks_used",
              "KV blocks in use, per layer group, of the pool every group shares.",
              labels=("group",)),
    MetricDef("gauge", "kvsparse_kv_blocks_free",
              "KV blocks free (cached prefix blocks included) in the pool every layer group "
              "shares."),
    MetricDef("histogram", "kvsparse_compression_ratio",
              "Prompt token-layers over kept token-layers, per finished request (1 = dense).",
              buckets=tuple(COMPRESSION_BUCKETS)),
    MetricDef("gauge", "kvsparse_layer_plan_info",
              "1, labelled with the layers the engine keeps whole and where they came from: "
              "calibrated (a calibrated profile), default (no profile: the first 3), configured "
              "or none (dense).",
              labels=("full_layers", "source")),
    MetricDef("gauge", "kvsparse_gpu_memory_peak_bytes",
              "Peak GPU memory of the engine process since it started, CUDA context included "
              "(rank 0's with tensor parallelism); absent off CUDA."),
]  # fmt: skip


def ray_metric_name(name: str) -> str:
    """The name a metric is registered under with Ray, which refuses `:` in names."""
    return name.replace(":", "_")


def ray_name(name: str) -> str:
    """A metric's name as Ray exports it: Ray's prefix `ray_` added to its registered name."""
    return "ray_" + ray_metric_name(name)


def series(d: MetricDef) -> list[str]:
    """The names of a metric's time series (a histogram's three)."""
    if d.kind == "histogram":
        return [d.name + suffix for suffix in ("_bucket", "_sum", "_count")]
    return [d.name]


# Every series under its Ray name, by its standalone name: what the chart's recording rules map.
RAY_NAMES = {s: ray_name(s) for d in DEFINITIONS for s in series(d)}


class _PromMetric:
    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def _child(self, labels: dict[str, str]) -> Any:
        return self._metric.labels(**labels) if labels else self._metric

    def inc(self, value: float, labels: dict[str, str]) -> None:
        self._child(labels).inc(value)

    def set(self, value: float, labels: dict[str, str]) -> None:
        self._child(labels).set(value)

    def observe(self, value: float, labels: dict[str, str]) -> None:
        self._child(labels).observe(value)


class _RayMetric:
    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def inc(self, value: float, labels: dict[str, str]) -> None:
        self._metric.inc(value, tags=labels)

    def set(self, value: float, labels: dict[str, str]) -> None:
        self._metric.set(value, tags=labels)

    def observe(self, value: float, labels: dict[str, str]) -> None:
        self._metric.observe(value, tags=labels)


def _prometheus_factory(registry: Any) -> Callable[[MetricDef, tuple[str, ...]], Any]:
    import prometheus_client as prom

    classes = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}

    def make(d: MetricDef, labels: tuple[str, ...]) -> _PromMetric:
        kwargs: dict[str, Any] = {"registry": registry}
        if d.kind == "histogram":
            kwargs["buckets"] = d.buckets
        return _PromMetric(classes[d.kind](d.name, d.help, labels, **kwargs))

    return make


def _ray_factory() -> Callable[[MetricDef, tuple[str, ...]], Any]:
    from ray.util import metrics as ray_metrics

    def make(d: MetricDef, labels: tuple[str, ...]) -> _RayMetric:
        name = ray_metric_name(d.name)
        if d.kind == "histogram":
            return _RayMetric(ray_metrics.Histogram(name, d.help, list(d.buckets), labels))
        cls = ray_metrics.Counter if d.kind == "counter" else ray_metrics.Gauge
        return _RayMetric(cls(name, d.help, labels))

    return make


class Metrics:
    """The process's metric objects; `recorder()` gives one engine's labelled view of them."""

    def __init__(
        self, make: Callable[[MetricDef, tuple[str, ...]], Any], base_labels: tuple[str, ...]
    ):
        self.base_labels = base_labels
        self._metrics = {d.name: make(d, base_labels + d.labels) for d in DEFINITIONS}

    @classmethod
    def prometheus(cls, registry: Any) -> Metrics:
        return cls(_prometheus_factory(registry), ("model_name", "pool"))

    @classmethod
    def ray(cls) -> Metrics:
        return cls(_ray_factory(), ("model_name", "pool", "replica"))

    def recorder(self, **labels: str) -> MetricsRecorder:
        if set(labels) != set(self.base_labels):
            raise ValueError(f"labels must be {self.base_labels}, got {sorted(labels)}")
        return MetricsRecorder(self._metrics, labels)


class MetricsRecorder:
    """What an engine worker records, with its labels (model, pool, replica) applied."""

    def __init__(self, metrics: dict[str, Any], labels: dict[str, str]) -> None:
        self._m = metrics
        self._labels = labels
        self._counted: dict[str, int] = {}  # engine counters already added, by metric
        self._plan_labels: dict[str, str] | None = None  # the layer plan's, once known

    def _with(self, **extra: str) -> dict[str, str]:
        return {**self._labels, **extra}

    def first_token(self, seconds: float) -> None:
        self._m["vllm:time_to_first_token_seconds"].observe(seconds, self._labels)

    def tokens(self, count: int, seconds_since_previous: float | None) -> None:
        """`count` new tokens of a request; the gap is spread evenly over them."""
        self._m["vllm:generation_tokens_total"].inc(count, self._labels)
        if seconds_since_previous is not None:
            for _ in range(count):
                self._m["vllm:inter_token_latency_seconds"].observe(
                    seconds_since_previous / count, self._labels
                )

    def prompt_tokens(self, count: int) -> None:
        """Counted once the prompt is prefilled (a recomputation after preemption is not)."""
        self._m["vllm:prompt_tokens_total"].inc(count, self._labels)

    def finished(
        self,
        reason: str,
        seconds: float,
        compression_ratio: float | None,
        time_per_output_token: float | None = None,
    ) -> None:
        """A request the engine ended: stop, length or abort."""
        self._m["vllm:request_success_total"].inc(1, self._with(finished_reason=reason))
        self._m["vllm:e2e_request_latency_seconds"].observe(seconds, self._labels)
        if time_per_output_token is not None:
            self._m["vllm:request_time_per_output_token_seconds"].observe(
                time_per_output_token, self._labels
            )
        if compression_ratio is not None:
            self._m["kvsparse_compression_ratio"].observe(compression_ratio, self._labels)

    def failed(self) -> None:
        """A request that failed on the server's side (answered 5xx)."""
        self._m["kvsparse_request_errors_total"].inc(1, self._labels)

    def layer_plan(self, plan: LayerPlan) -> None:
        """The engine's layer plan, at start-up (and again with every engine state: Ray's
        exporter may not yet run when a replica starts)."""
        whole = ",".join(map(str, plan.full_layers)) or "none"
        self._plan_labels = self._with(full_layers=whole, source=plan.source)
        self._m["kvsparse_layer_plan_info"].set(1, self._plan_labels)

    def engine_state(self, stats: EngineStats) -> None:
        if self._plan_labels is not None:
            self._m["kvsparse_layer_plan_info"].set(1, self._plan_labels)
        self._m["vllm:num_requests_running"].set(stats.num_running, self._labels)
        self._m["vllm:num_requests_waiting"].set(stats.num_waiting, self._labels)
        for group, blocks in stats.kv_blocks.items():
            self._m["kvsparse_kv_blocks_used"].set(blocks["used"], self._with(group=group))
            self._m["kvsparse_kv_blocks_free"].set(blocks["free"], self._labels)
        self._m["vllm:kv_cache_usage_perc"].set(stats.kv_used_fraction, self._labels)
        if stats.gpu_memory_peak_bytes is not None:
            self._m["kvsparse_gpu_memory_peak_bytes"].set(stats.gpu_memory_peak_bytes, self._labels)
        self._count("vllm:num_preemptions_total", stats.num_preemptions)
        self._count("vllm:prefix_cache_queries_total", stats.prefix_cache_queries)
        self._count("vllm:prefix_cache_hits_total", stats.prefix_cache_hits)

    def _count(self, name: str, engine_total: int) -> None:
        """Add what an engine's running total gained since the last call."""
        new = engine_total - self._counted.get(name, 0)
        if new > 0:
            self._m[name].inc(new, self._labels)
            self._counted[name] = engine_total

"""How load spreads over engine replicas, read from Ray's metrics while a benchmark runs.

    python -m sparse_core.bench.replica_load --metrics-url http://127.0.0.1:8080/metrics --output F.json

Polls the Prometheus text of a Ray node until interrupted (SIGINT), then writes and prints, per
engine replica: requests finished meanwhile, the most requests running and waiting at once, the
highest KV use, and its engine process's peak GPU memory (on a GPU).
Samples where one replica ran nothing while another had requests waiting are counted: the
KV-capacity router should leave none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time
from collections import defaultdict
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# What is read, by the name the report gives it (Ray's names of service/metrics.py's series).
READ = {
    "ray_vllm_num_requests_running": "num_requests_running",
    "ray_vllm_num_requests_waiting": "num_requests_waiting",
    "ray_vllm_request_success_total": "requests_finished_total",
    "ray_vllm_kv_cache_usage_perc": "kv_used_fraction",
    "ray_kvsparse_gpu_memory_peak_bytes": "gpu_memory_peak_bytes",
}


def sample(text: str) -> dict[str, dict[str, float]]:
    """replica -> {name in READ's values: the value summed over other labels}."""
    values: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            replica = s.labels.get("replica")
            if replica is not None and s.name in READ:
                values[replica][READ[s.name]] += s.value
    return values


def summarize(samples: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    replicas = sorted({r for s in samples for r in s})
    finished = "requests_finished_total"
    per_replica = {}
    for r in replicas:
        seen = [s[r] for s in samples if r in s]
        memory = [v["gpu_memory_peak_bytes"] for v in seen if "gpu_memory_peak_bytes" in v]
        per_replica[r] = {
            "requests_finished": seen[-1].get(finished, 0) - seen[0].get(finished, 0),
            "max_running": max(v.get("num_requests_running", 0) for v in seen),
            "max_waiting": max(v.get("num_requests_waiting", 0) for v in seen),
            "max_kv_used_fraction": round(max(v.get("kv_used_fraction", 0) for v in seen), 3),
            "gpu_memory_peak_gib": round(max(memory) / 2**30, 2) if memory else None,
        }
    idle_while_queued = sum(
        1
        for s in samples
        if any(v.get("num_requests_running", 0) == 0 for v in s.values())
        and any(v.get("num_requests_waiting", 0) > 0 for v in s.values())
    )
    return {"samples": len(samples), "idle_while_another_queued": idle_while_queued,
            "replicas": per_replica}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics-url", required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    stop = False

    def interrupt(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, interrupt)
    samples = []
    while not stop:
        with contextlib.suppress(httpx.HTTPError):  # the exporter starts after the cluster
            samples.append(sample(httpx.get(args.metrics_url, timeout=5).text))
        time.sleep(args.interval)
    report = summarize([s for s in samples if s])
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

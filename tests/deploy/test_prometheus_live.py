"""A real Prometheus scrapes a running kvsparse (Ray Serve mode) after some traffic, with the
chart's rules loaded (its recording rules give Ray's series their standalone names); every
dashboard and alert-rule expression evaluates without error, the dashboard's return data, and
so do the queries of vLLM's own Grafana dashboard (vLLM's names, in the form its panels use).

Runs a local Ray cluster, the built-in model and a Prometheus server (about 40 s). Needs the
`prometheus` binary (Debian package prometheus, which .ci/run installs); skips without it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.test_manifests_dashboards import GRAFANA_VARS, alert_rules, dashboard_exprs
from tests.service.servers import API_KEY, MODEL, free_port, ray_serve_app, wait_for

ARGS = {
    "model": MODEL,
    "engine": {"max_model_len": 256, "max_num_seqs": 8, "kv_cache_memory_gb": 0.1},
    "sparsity": {"policy": "snapkv", "budget": 32, "window": 8, "sinks": 4, "full_layers": 2},
    "api_key": API_KEY,
}
# Series only recorded when their event happens (no preemption in this light load) or on a GPU.
NOT_HERE = ("vllm:num_preemptions_total", "kvsparse_gpu_memory_peak_bytes")
# The panels of vLLM's example Grafana dashboard (examples/observability/prometheus_grafana in
# vLLM's repository), by the queries' form: what a user who brings that dashboard sees.
VLLM_DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval]) / rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:request_time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
]  # fmt: skip


@pytest.fixture(scope="module")
def ray_app() -> Iterator[tuple[str, str]]:
    """(OpenAI base URL, Ray metrics address) of the application on a local cluster."""
    with ray_serve_app(ARGS, "kvsparse", with_metrics=True) as app:
        yield app.v1, app.metrics_address


@pytest.fixture(scope="module")
def prometheus(
    ray_app: tuple[str, str], tmp_path_factory: pytest.TempPathFactory, helm: str
) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "rules.yaml").write_text(yaml.safe_dump({"groups": alert_rules(helm)}))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp / "rules.yaml")],
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [ray_app[1]]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "log").open("w"),
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ready(url), timeout=60, interval=0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, expr: str) -> dict[str, Any]:
    for var, value in {"$model_name": MODEL, **GRAFANA_VARS}.items():  # before its prefix $model
        expr = expr.replace(var, value)
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]


def send_traffic(base_url: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        for i in range(6):
            body = {"model": MODEL, "prompt": f"Count to {i + 5}:", "max_tokens": 16}
            assert client.post("/completions", json=body).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "stream": True}  # fmt: skip
        with client.stream("POST", "/chat/completions", json=chat) as response:
            assert response.status_code == 200
            response.read()
        too_long = {"model": MODEL, "prompt": [1] * 300, "max_tokens": 4}  # an error
        assert client.post("/completions", json=too_long).status_code == 400


def test_dashboard_and_alert_queries_evaluate(ray_app, prometheus: str, helm: str) -> None:
    send_traffic(ray_app[0])
    # Ray reports every second here; wait until Prometheus has the requests' series, then once
    # more traffic so that rates see an increase inside their window.
    wait_for(lambda: query(prometheus, "vllm:request_success_total")["result"],
             timeout=90, interval=1)  # fmt: skip
    send_traffic(ray_app[0])
    time.sleep(8)

    empty = []
    for expr in dashboard_exprs():
        if not query(prometheus, expr)["result"] and not any(m in expr for m in NOT_HERE):
            empty.append(expr)
    assert not empty, f"dashboard queries without data: {empty}"
    empty = [expr for expr in VLLM_DASHBOARD if not query(prometheus, expr)["result"]]
    assert not empty, f"vLLM's dashboard's queries without data: {empty}"
    for group in alert_rules(helm):
        for rule in group["rules"]:
            result = query(prometheus, rule["expr"])["result"]  # evaluates
            if rule.get("alert") == "KVSparseNoReadyReplica":
                assert not result, "fires on a healthy application"

"""The per-replica summary of a benchmark's load, from Ray's Prometheus text."""

from __future__ import annotations

from sparse_core.bench.replica_load import sample, summarize


def _text(running_a: int, waiting_b: int, finished_a: int, memory_a: float | None) -> str:
    lines = [
        "# TYPE ray_vllm_num_requests_running gauge",
        f'ray_vllm_num_requests_running{{pool="p",replica="a"}} {running_a}',
        'ray_vllm_num_requests_running{pool="p",replica="b"} 2',
        "# TYPE ray_vllm_num_requests_waiting gauge",
        'ray_vllm_num_requests_waiting{pool="p",replica="a"} 0',
        f'ray_vllm_num_requests_waiting{{pool="p",replica="b"}} {waiting_b}',
        "# TYPE ray_vllm_request_success_total counter",
        f'ray_vllm_request_success_total{{finished_reason="length",replica="a"}} {finished_a}',
        "# TYPE ray_vllm_kv_cache_usage_perc gauge",
        'ray_vllm_kv_cache_usage_perc{pool="p",replica="a"} 0.75',
        # A series of another name is not read.
        "# TYPE ray_kvsparse_kv_blocks_used gauge",
        'ray_kvsparse_kv_blocks_used{group="full",replica="a"} 30',
    ]
    if memory_a is not None:
        lines += [
            "# TYPE ray_kvsparse_gpu_memory_peak_bytes gauge",
            f'ray_kvsparse_gpu_memory_peak_bytes{{pool="p",replica="a"}} {memory_a}',
        ]
    return "\n".join(lines) + "\n"


def test_summary_per_replica() -> None:
    samples = [
        sample(_text(running_a=3, waiting_b=0, finished_a=5, memory_a=None)),
        sample(_text(running_a=0, waiting_b=4, finished_a=9, memory_a=20 * 2**30)),
        sample(_text(running_a=1, waiting_b=0, finished_a=12, memory_a=21.5 * 2**30)),
    ]
    report = summarize(samples)
    assert report["samples"] == 3
    assert report["idle_while_another_queued"] == 1  # the second sample
    a, b = report["replicas"]["a"], report["replicas"]["b"]
    assert a["requests_finished"] == 7 and a["max_running"] == 3
    assert a["max_kv_used_fraction"] == 0.75
    assert "kv_blocks_used" not in samples[0]["a"]
    assert a["gpu_memory_peak_gib"] == 21.5
    assert b["max_waiting"] == 4 and b["gpu_memory_peak_gib"] is None  # not on a GPU

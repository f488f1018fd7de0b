"""`kvsparse bench throughput` end to end on a tiny random model (on CPU a smoke test of the
benchmark: no roofline), with chunked prefill."""

from __future__ import annotations

import json
import subprocess
import sys


def test_throughput_benchmark_reports_every_policy_and_where_the_time_went(tmp_path):
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "throughput", "--model", "dummy:tiny",
         "--policies", "dense,snapkv", "--num-prompts", "3", "--input-len", "80",
         "--output-len", "6", "--budget", "32", "--window", "8", "--full-layers", "1",
         "--max-model-len", "256", "--enable-chunked-prefill", "--max-num-batched-tokens", "64",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "launching prefill/decode" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["label"] for r in results] == ["dense uncapped", "snapkv 1 full uncapped"]
    for r in results:
        assert r["output_tok_s"] > 0
        assert r["num_prompts"] == 3
        for kind in ("prefill_steps", "decode_steps"):
            assert 0 <= r["launch_s"][kind] <= r["time_split_s"][kind] + 0.01
    # The same cache in blocks of every layer (dense: one group of 4) and of one (1 whole, 3
    # sparse layers).
    assert results[0]["kv_cache_gib"] == results[1]["kv_cache_gib"]
    assert results[1]["kv_blocks"] == 4 * results[0]["kv_blocks"]
    # A sequence ends holding its 80 prompt tokens and the 5 fed after them in all 4 layers
    # (dense), or in its whole layer and 32 + 5 in each of the 3 sparse ones.
    dense, snapkv = (r["kv_bytes_per_seq_held"] for r in results)
    assert dense > 0 and snapkv * 4 * 85 == dense * (85 + 3 * 37)

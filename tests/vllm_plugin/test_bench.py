"""The plugin's benchmark (stock vLLM beside vLLM with the plugin), run for real on SmolLM2: both
engines in their own processes, the same tokens out, and the KV capacity the plugin frees."""

from __future__ import annotations

import json

import pytest

from tests.vllm_plugin.conftest import MODEL

pytest.importorskip("vllm")
from sparse_core.bench import vllm_plugin as bench
from sparse_core.vllm_plugin.kv_spec import gap_blocks

PROMPTS, INPUT_LEN, OUTPUT_LEN, BUDGET, BLOCK = 2, 300, 24, 64, 32


def run_bench(tmp_path, num_prompts: int, output_len: int, *extra: str) -> list[dict]:
    """Both engines on SmolLM2 in float32, every layer sparse; their results."""
    out = tmp_path / "bench.json"
    args = ["--model", MODEL, "--num-prompts", str(num_prompts), "--input-len", str(INPUT_LEN),
            "--output-len", str(output_len), "--budget", str(BUDGET), "--full-layers", "0",
            "--gpu-memory-utilization", "0.5", "--engine-arg", f"block_size={BLOCK}",
            "--engine-arg", "dtype=float32", "--engine-arg", "enforce_eager=true",
            *extra, "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    return json.loads(out.read_text())["results"]


def test_the_plugin_frees_the_dropped_blocks_of_every_running_sequence(tmp_path):
    stock, plugin = run_bench(tmp_path, PROMPTS, OUTPUT_LEN)
    assert stock["sparsity"] == "none" and plugin["sparsity"].startswith("snapkv, budget 64")
    for run in (stock, plugin):
        assert run["output_tokens"] == PROMPTS * OUTPUT_LEN
        assert run["most_running"] == PROMPTS
    assert stock["kv_blocks"] == plugin["kv_blocks"]
    # Every layer is sparse (one budget group): while both sequences decode, the plugin's pool
    # has each prompt's gap blocks free, which stock vLLM holds.
    gap = PROMPTS * len(gap_blocks(BUDGET, INPUT_LEN, BLOCK))
    assert gap > 0
    assert plugin["free_blocks_at_most_running"] - stock["free_blocks_at_most_running"] == gap


def test_engine_cores_in_process_run_both_engines_to_the_end(tmp_path):
    """--engine-in-process (vLLM's engine core inside each engine's process, for torch's memory
    figures on a GPU) runs both engines to their last token; off a GPU it adds no memory
    figures."""
    for run in run_bench(tmp_path, 1, 8, "--engine-in-process"):
        assert run["output_tokens"] == 8
        assert "torch_reserved_peak_gib" not in run


def test_bad_arguments_are_refused():
    assert bench.main(["--engines", "stock,nope"]) == 2
    with pytest.raises(SystemExit):
        bench.main(["--engine-arg", "no-equals-sign"])

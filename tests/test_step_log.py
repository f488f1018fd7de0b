"""`EngineConfig.step_log` / `--step-log`: every engine step as a JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import torch

from sparse_core import LLM, SamplingParams


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_is_logged_as_the_engine_records_it(tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = LLM("dummy:tiny", kv_cache_memory_gb=0.01, max_model_len=256, step_log=str(path))
    llm.engine.step_records = []
    prompts = [[(7 * i) % 250 + 1 for i in range(40)], [(3 * i) % 250 + 1 for i in range(25)]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    llm.shutdown()
    assert [len(o.token_ids) for o in outs] == [5, 5]
    lines = read_lines(path)
    # The engine's own step records, with when each step ended and which engine (pool) ran it:
    # the default's, snapkv at 512.
    engine = {"policy": "snapkv", "budget": 512}
    assert [{k: v for k, v in line.items() if k != "end_unix_s"} for line in lines] == [
        {**engine, **asdict(r)} for r in llm.engine.step_records
    ]
    # Both prompts in the first step, then a token per sequence per step.
    assert [(line["num_prefill_seqs"], line["num_decode_seqs"]) for line in lines] == [(2, 0)] + [
        (0, 2)
    ] * 4
    assert lines[0]["num_prefill_tokens"] == 65
    ends = [line["end_unix_s"] for line in lines]
    assert ends == sorted(ends)
    assert all(line["seconds"] > 0 for line in lines)
    # Triton's first launches: none on a CPU (torch ops); on a GPU, the first steps may launch
    # kernel variants the start-up did not.
    first_launches = [line["kernel_first_launch_seconds"] for line in lines]
    if torch.cuda.is_available():
        assert all(t >= 0 for t in first_launches)
    else:
        assert first_launches == [0] * len(lines)


def test_the_cli_flag_reaches_the_engine(tmp_path):
    path = tmp_path / "steps.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "generate", "hello", "--model", "dummy:tiny",
         "--max-tokens", "3", "--ignore-eos", "--step-log", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = read_lines(path)
    assert lines[0]["num_prefill_seqs"] == 1
    assert sum(line["num_decode_seqs"] for line in lines) == 2

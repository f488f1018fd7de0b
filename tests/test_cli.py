"""The `kvsparse` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_with_the_built_in_model():
    proc = run_cli(
        "generate",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--policy",
        "snapkv",
        "--budget",
        "64",
        "--window",
        "8",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["finish_reason"] in ("stop", "length")
    assert summary["completion_tokens"] >= 1


def assert_usage_error(message: str, *args: str) -> None:
    """The command exits with status 2 and a message, not a traceback."""
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_flag_value_is_a_clear_error():
    assert_usage_error(
        "budget (16) must be greater than window (32)",
        *("generate", "hi", "--policy", "snapkv", "--budget", "16", "--window", "32"),
        *("--model", "dummy:tiny"),
    )


def test_chunked_prefill_allows_steps_shorter_than_a_prompt():
    """The prompt (~60 tokens) goes in chunks of 16, its last holding the 8-token window."""
    proc = run_cli(
        *("generate", "What is the capital of France? " * 6, "--max-tokens", "4"),
        *("--policy", "snapkv", "--budget", "32", "--window", "8", "--device", "cpu"),
        *("--enable-chunked-prefill", "--max-num-batched-tokens", "16"),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stderr.strip().splitlines()[-1])["completion_tokens"] >= 1

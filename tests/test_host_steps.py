"""The host-side load of `python -m sparse_core.bench.host_steps`, at a small size."""

from __future__ import annotations

from sparse_core.bench.host_steps import main


def test_a_shared_prefix_load_runs_to_its_end_and_finds_the_prefix(capsys) -> None:
    # Two waves of 4 prompts of 600 tokens: the second finds the first's 4 full blocks of 128
    # tokens of the shared 512 (the last 32 of a prompt are always computed).
    args = ["--num-prompts", "8", "--input-len", "600", "--output-len", "4", "--max-num-seqs", "4"]
    assert main([*args, "--shared-prefix-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "prefill steps: 2," in out and "decode steps: 6," in out
    assert f"prefix cache: {4 * 512} of {8 * 600} prefill tokens found" in out
    assert main([*args, "--shared-prefix-len", "512", "--no-enable-prefix-caching"]) == 0
    assert f"prefix cache: 0 of {8 * 600}" in capsys.readouterr().out

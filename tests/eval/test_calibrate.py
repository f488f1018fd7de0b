"""Budget arithmetic, band selection, and the calibrate command's output (measurements faked)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sparse_core.eval import calibrate as cal
from sparse_core.eval.runner import EvalConfig
from sparse_core.models.config import DUMMY_PRESETS


@pytest.mark.parametrize("full", [0, 3, 10])
def test_matched_budget_gives_the_effective_ratio(full):
    n, layers = 1000, 30
    config = EvalConfig("snapkv", 2.0, full, match_effective=True)
    budget = config.budget(n, layers, full)
    kept = full * n + (layers - full) * budget
    assert n * layers / kept == pytest.approx(2.0, rel=0.01)


def test_nominal_budget_is_length_over_ratio():
    assert EvalConfig("snapkv", 4.0).budget(1000, 30, 0) == 250
    assert EvalConfig("dense").budget(1000, 30, 30) is None


def test_most_sensitive_bands_are_kept_whole():
    sens = [
        cal.BandSensitivity([0, 1, 2], damage=1, rescue=0),
        cal.BandSensitivity([3, 4, 5], damage=30, rescue=20),
        cal.BandSensitivity([6, 7, 8], damage=10, rescue=5),
    ]
    assert cal.choose_full_layers(sens, 4) == [3, 4, 5, 6]
    assert cal.bands(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_calibrate_writes_a_loadable_profile(tmp_path, monkeypatch):
    from sparse_core.cli import build_parser
    from sparse_core.eval import cli as eval_cli
    from sparse_core.eval.runner import SampleResult

    def fake_run_suite(configs, samples, settings, progress=True, source=None):
        # Layers 10-14 matter: compressing them loses everything, keeping them whole saves it.
        def acc(c: EvalConfig) -> float:
            if c.name == "dense":
                return 1.0
            full = set(c.full_layers) if isinstance(c.full_layers, list) else set()
            return 1.0 if set(range(10, 15)) <= full else 0.0

        return [SampleResult(c.name, "t", 500, 0, None, 500, acc(c), 2.0, "") for c in configs]

    monkeypatch.setattr(eval_cli, "_samples", lambda args: ([], _FakeSource()))
    monkeypatch.setattr(eval_cli, "_build_samples", lambda args, source, seed: [])
    monkeypatch.setattr(cal, "run_suite", fake_run_suite)
    monkeypatch.setattr(eval_cli, "run_suite", fake_run_suite)
    profile = tmp_path / "profile.json"
    args = build_parser().parse_args(
        ["calibrate", "--band-size", "5", "--num-full", "5", "--profile", str(profile)]
    )
    assert args.func(args) == 0
    data = json.loads(profile.read_text())
    assert data["full_layers"] == [10, 11, 12, 13, 14]
    assert {"sensitivity", "command", "suite"} <= set(data)


class _FakeSource:
    config = dataclasses.replace(DUMMY_PRESETS["smollm2-135m"], name="fake-model")  # 30 layers


def test_shipped_profile_loads_for_auto():
    from sparse_core.config import SparsityConfig
    from sparse_core.policy import plan_layers

    plan = plan_layers(
        SparsityConfig(policy="snapkv", budget=128, full_layers="auto"), 30, "smollm2-135m-instruct"
    )
    assert 0 < len(plan.full_layers) < 30


def test_a_profile_calibrated_where_the_model_is_served_is_the_engines_default(
    tmp_path, monkeypatch
):
    """What the Helm chart's calibration step does: `kvsparse calibrate --skip-existing` into
    $KVSPARSE_PROFILE_DIR, then engines with full_layers unset keep its layers whole (before it
    exists: the first 3). Real calibration runs on a random-weight model, so the bands tie."""
    from sparse_core.cli import build_parser
    from sparse_core.config import SparsityConfig
    from sparse_core.policy import PROFILE_DIR_ENV, plan_layers

    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    sparsity = SparsityConfig(policy="snapkv", budget=64, window=8, sinks=4)
    before = plan_layers(sparsity, 4, "dummy:tiny")
    assert (before.full_layers, before.source) == ([0, 1, 2], "default")

    argv = ["calibrate", "--model", "dummy:tiny", "--tasks", "passkey", "--lengths", "300",
            "--samples", "1", "--band-size", "2", "--num-full", "2", "--window", "8",
            "--compare-ratios", "", "--skip-existing"]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    profile = tmp_path / "dummy:tiny.json"
    written = json.loads(profile.read_text())
    assert len(written["full_layers"]) == 2 and written["model"] == "dummy:tiny"

    after = plan_layers(sparsity, 4, "dummy:tiny")
    assert (after.full_layers, after.source) == (written["full_layers"], "calibrated")
    assert after.full_layers != before.full_layers

    # A second install step finds it and leaves it as it is.
    mtime = profile.stat().st_mtime_ns
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    assert profile.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_calibration_runs_on_qwen3_and_gemma3_over_the_layers_it_can_compress(
    tmp_path, architecture
):
    """`kvsparse calibrate` end to end on a small random Qwen3 checkpoint saved by
    transformers, and on Gemma 3's tiny preset, whose profile counts only the 2 global layers of
    its 6 (the sliding-window ones keep their window whatever the profile); an engine's plan
    then keeps the profile's layer whole, and Gemma's local layers in a group of their own."""
    from sparse_core.cli import build_parser
    from sparse_core.config import SparsityConfig
    from sparse_core.models.loader import load_model_source
    from sparse_core.policy import plan_layers
    from tests.hf_checkpoints import save_checkpoint, tiny_qwen3

    model = (
        str(save_checkpoint(tiny_qwen3(), tmp_path / "qwen3"))
        if architecture == "qwen3"
        else "dummy:gemma3-tiny"
    )
    profile = tmp_path / "profile.json"
    argv = ["calibrate", "--model", model, "--tasks", "passkey", "--lengths", "300",
            "--samples", "1", "--band-size", "1", "--num-full", "1", "--window", "8",
            "--compare-ratios", "", "--profile", str(profile)]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    written = json.loads(profile.read_text())
    scored = 3 if architecture == "qwen3" else 2
    assert [band["layers"] for band in written["sensitivity"]] == [[i] for i in range(scored)]
    (kept,) = written["full_layers"]

    config = load_model_source(model).config
    sparsity = SparsityConfig(policy="snapkv", budget=64, full_layers=written["full_layers"])
    plan = plan_layers(sparsity, config.num_hidden_layers, config.name, config.sliding)
    whole = [g for g in plan.groups if g.budget is None and g.sliding_window is None]
    global_layers = [i for i in range(config.num_hidden_layers) if not config.is_sliding(i)]
    assert [layer for g in whole for layer in g.layers] == [global_layers[kept]]
    if architecture == "gemma3":
        (local,) = [g for g in plan.groups if g.sliding_window is not None]
        assert list(local.layers) == [0, 1, 3, 4]

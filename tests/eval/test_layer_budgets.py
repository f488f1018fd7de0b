"""Per-layer budget calibration: the allocation, the sensitivity measure, and the calibrate
command run end to end on a small model."""

from __future__ import annotations

import json

import pytest

from sparse_core.eval import layer_budgets as lb
from sparse_core.eval.runner import SampleResult
from sparse_core.policy import BudgetProfile, ratios_compression


def _bands(*damage: dict[int, float], size: int = 2) -> list[lb.BandDamage]:
    return [lb.BandDamage(list(range(i * size, (i + 1) * size)), d) for i, d in enumerate(damage)]


def test_allocation_spends_the_memory_on_the_sensitive_band():
    damages = _bands(
        {2: 0.0, 4: 0.0, 8: 1.0},
        {2: 30.0, 4: 60.0, 8: 90.0},  # layers 2-3: compressing them costs most
        {2: 0.0, 4: 5.0, 8: 10.0},
    )
    ratios, damage = lb.allocate(damages, 6, target=2.0)
    assert ratios[2:4] == (None, None)
    assert ratios_compression(ratios) >= 2.0
    chosen = zip(damages, ratios[::2], strict=True)
    assert damage == pytest.approx(sum(d.damage[r] for d, r in chosen if r))


@pytest.mark.parametrize("target", [1.5, 2.0, 3.0, 4.0, 6.0])
def test_allocation_meets_every_reachable_target(target):
    damages = _bands(*[{2: 1.0 * i, 4: 2.0 * i, 8: 4.0 * i} for i in range(5)], size=3)
    ratios, _ = lb.allocate(damages, 15, target)
    assert target <= ratios_compression(ratios) <= target * 1.25


def test_allocation_without_signal_spreads_compression_evenly():
    damages = _bands(*[{2: 0.0, 4: 0.0, 8: 0.0}] * 4, size=1)
    assert lb.allocate(damages, 4, target=4.0)[0] == (4, 4, 4, 4)


def test_unreachable_target_is_refused():
    with pytest.raises(ValueError, match="beyond levels"):
        lb.allocate(_bands({2: 0.0, 4: 0.0}), 2, target=5.0)


def test_divergence_counts_the_lost_part_of_the_answer():
    assert lb.divergence(" 52890.", " 52890.") == 0.0
    assert lb.divergence(" 52890.", " 528.") == pytest.approx(3 / 7)
    assert lb.divergence(" 52890.", "") == 1.0


def _result(config: str, output: str, index: int = 0) -> SampleResult:
    return SampleResult(config, "t", 500, index, None, 500, 0.0, 1.0, output)


def test_damage_is_measured_against_dense_and_never_falls_with_compression():
    results = [_result("dense", "abcd")]
    results += [_result(f"L0-1 at {r}x", out) for r, out in ((2, "abcd"), (4, "ab"), (8, "abc"))]
    results += [_result(f"L2 at {r}x", "abcd") for r in (2, 4, 8)]
    (first, second) = lb.measure(results, {("t", 500, 0): ["abcd"]}, 3, 2, [2, 4, 8])
    assert first.damage == {2: 0.0, 4: 50.0, 8: 50.0}
    assert second.damage == {2: 0.0, 4: 0.0, 8: 0.0}


def test_damage_counts_only_answers_dense_gives():
    """Text after dense's answer, and probes dense does not answer, have nothing to lose."""
    answers = {("t", 500, 0): ["5289"], ("t", 500, 1): ["7777"]}
    results = [_result("dense", " 5289. It is a key.", 0), _result("dense", " no idea.", 1)]
    results += [_result("L0 at 2x", " 5289. It was one.", 0), _result("L0 at 2x", " none", 1)]
    results += [_result("L0 at 4x", " 52.", 0), _result("L0 at 4x", " 7777", 1)]
    (band,) = lb.measure(results, answers, 1, 1, [2, 4])
    assert band.damage == {2: 0.0, 4: 40.0}  # " 5289" loses "89", 2 of its 5 characters, at 4x
    assert lb.answer_part(" The KEY is 5289. Yes", ["key", "5289"]) == " The KEY is 5289"
    assert lb.answer_part(" nothing", ["5289"]) == ""


def test_refinement_moves_each_band_alone_from_the_operating_point():
    base = (2, 2, None, 4)
    configs = lb.refine_configs(base, 2, [2, 4], "3x")
    assert configs[0].layer_budgets == base and configs[0].name == "3x: operating point"
    moved = {c.name: c.layer_budgets for c in configs[1:]}
    # Band L0-1 (at 2x) goes whole and to 4x; band L2-3 (mixed) to whole, 2x and 4x.
    assert moved == {
        "3x: L0-1 whole": (None, None, None, 4),
        "3x: L0-1 at 4x": (4, 4, None, 4),
        "3x: L2-3 whole": (2, 2, None, None),
        "3x: L2-3 at 2x": (2, 2, 2, 2),
        "3x: L2-3 at 4x": (2, 2, 4, 4),
    }
    assert all(c.ratio == ratios_compression(c.layer_budgets) for c in configs)


def test_refinement_measures_changes_against_the_operating_point():
    """Damage is relative to the operating point (negative where a band gives answers back),
    0 at the band's own option; keeping more never costs and keeping less never gives back."""
    answers = {("t", 500, 0): ["abcd"]}
    results = [_result("dense", "abcd"), _result("4x: operating point", "ab")]  # 50 points lost
    results += [_result("4x: L0 whole", "abcd"), _result("4x: L0 at 2x", "abc")]
    results += [_result("4x: L1 whole", "ab"), _result("4x: L1 at 2x", "a")]  # noise: worse
    results += [_result("4x: L0 at 8x", ""), _result("4x: L1 at 8x", "a")]
    changes, at_base = lb.measure_around(results, answers, (4, 4), 1, [2, 4, 8], "4x")
    assert at_base == 50.0
    assert changes[0].damage == {None: -50.0, 2: -25.0, 4: 0.0, 8: 50.0}
    assert changes[1].damage == {None: 0.0, 2: 0.0, 4: 0.0, 8: 25.0}


def test_allocation_by_changes_keeps_whole_the_band_that_gives_answers_back():
    changes = _bands(
        {None: -50.0, 2: 0.0, 4: 1.0},  # layer 0 whole gives answers back
        *[{None: 0.0, 2: 0.0, 4: 0.0}] * 3,
        size=1,
    )
    ratios, damage = lb.allocate(changes, 4, target=2.0)
    assert ratios[0] is None and ratios_compression(ratios) == 2.0  # the rest fills the memory
    assert damage == pytest.approx(-50.0)


def test_calibrate_writes_one_loadable_profile_per_target(tmp_path):
    """The real command on dummy:tiny (4 layers, random weights): one probe run, two profiles."""
    from sparse_core.cli import main

    args = [
        "calibrate",
        "--model",
        "dummy:tiny",
        "--target-compression",
        "2,3",
        "--levels",
        "2,4",
        "--band-size",
        "2",
        "--tasks",
        "passkey",
        "--lengths",
        "400",
        "--samples",
        "1",
        "--window",
        "16",
        "--device",
        "cpu",
        "--kv-cache-memory-gb",
        "0.01",
        "--profile-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    for target in (2.0, 3.0):
        profile = BudgetProfile.load(tmp_path / f"{target:g}x.json")
        assert profile.target_compression == target
        assert len(profile.layer_ratios) == 4
        assert ratios_compression(profile.layer_ratios) >= target
        data = json.loads(profile.path.read_text())
        assert len(data["sensitivity"]) == 2
        assert data["seed"] == 1  # probes are not the evaluation's samples
    with pytest.raises(SystemExit):  # 400 / 32 tokens cannot hold window and sinks
        main([*args[:-2], "--levels", "32", "--profile-dir", str(tmp_path)])


def test_calibrate_refines_around_each_allocation(tmp_path, capsys):
    """--refine on dummy:tiny: each profile records its operating point (the first
    allocation) and the changes measured there; the comparison shows the first allocation
    beside the refined one wherever they differ."""
    from sparse_core.cli import main

    args = ["calibrate", "--model", "dummy:tiny", "--target-compression", "2,3", "--levels",
            "2,4", "--band-size", "2", "--tasks", "passkey", "--lengths", "400", "--samples",
            "1", "--window", "16", "--device", "cpu", "--kv-cache-memory-gb", "0.01",
            "--profile-dir", str(tmp_path), "--refine"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for target in (2.0, 3.0):
        profile = BudgetProfile.load(tmp_path / f"{target:g}x.json")
        assert ratios_compression(profile.layer_ratios) >= target
        refinement = json.loads(profile.path.read_text())["refinement"]
        assert ratios_compression(refinement["operating_point"]) >= target
        assert [band["layers"] for band in refinement["changes"]] == [[0, 1], [2, 3]]
        assert all(set(b["damage"]) == {"whole", "2", "4"} for b in refinement["changes"])
        changed = tuple(refinement["operating_point"]) != profile.layer_ratios
        assert (f"first-pass@{target:g}x" in out) == changed
        assert f"budgets@{target:g}x" in out

"""Summaries of a sweep: the two query settings apart, side by side, and in the plot."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from sparse_core.cli import build_parser
from sparse_core.eval.report import markdown_table, plot, settings_table, summarize
from sparse_core.eval.runner import SampleResult


def result(config: str, setting: str, score: float, compression: float) -> SampleResult:
    return SampleResult(config, "passkey", 500, 0, None, 490, score, compression, "", setting)


RESULTS = [
    result("dense", "query-aware", 1.0, 1.0),
    result("dense", "query-agnostic", 1.0, 1.0),
    result("snapkv@4x", "query-aware", 1.0, 3.9),
    result("snapkv@4x", "query-aware", 0.0, 3.9),
    result("snapkv@4x", "query-agnostic", 0.0, 2.8),
    result("snapkv@4x", "query-agnostic", 0.0, 2.8),
]


def test_settings_are_summarized_apart():
    rows = summarize(RESULTS)
    assert {(r.config, r.setting): r.overall for r in rows} == {
        ("dense", "query-aware"): 100.0,
        ("dense", "query-agnostic"): 100.0,
        ("snapkv@4x", "query-aware"): 50.0,
        ("snapkv@4x", "query-agnostic"): 0.0,
    }


def test_tables_show_both_settings():
    rows = summarize(RESULTS)
    side = settings_table(rows).splitlines()
    assert side[0] == (
        "| config | query-aware accuracy (%) | query-agnostic accuracy (%) | "
        "query-aware effective | query-agnostic effective |"
    )
    assert "| snapkv@4x | **50.0** | **0.0** | 3.90x | 2.80x |" in side
    lines = markdown_table(rows).splitlines()
    assert lines[2:] == [
        "| dense | query-aware | 1.00x | 100.0 | **100.0** |",
        "| dense | query-agnostic | 1.00x | 100.0 | **100.0** |",
        "| snapkv@4x | query-aware | 3.90x | 50.0 | **50.0** |",
        "| snapkv@4x | query-agnostic | 2.80x | 0.0 | **0.0** |",
    ]


def test_one_setting_keeps_the_table_without_a_setting_column():
    rows = summarize([r for r in RESULTS if r.setting == "query-aware"])
    assert markdown_table(rows).splitlines()[0] == (
        "| config | effective compression | length 500 | all |"
    )


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "accuracy.png"
    plot(summarize(RESULTS), str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_command_renders_a_results_file(tmp_path, capsys):
    results = tmp_path / "eval.json"
    results.write_text(json.dumps([asdict(r) for r in RESULTS]))
    md, png = tmp_path / "eval.md", tmp_path / "eval.png"
    args = build_parser().parse_args(
        ["eval", "--results", str(results), "--markdown", str(md), "--plot", str(png)]
    )
    assert args.func(args) == 0
    assert md.read_text().startswith(settings_table(summarize(RESULTS)))
    assert png.exists()
    assert "query-agnostic" in capsys.readouterr().out


def test_eval_command_rejects_an_unknown_setting():
    args = build_parser().parse_args(["eval", "--settings", "query-aware,blind"])
    with pytest.raises(ValueError, match="query settings must be among"):
        args.func(args)

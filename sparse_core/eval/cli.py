"""`kvsparse eval` and `kvsparse calibrate`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from datetime import date
from pathlib import Path

from sparse_core.config import POLICIES
from sparse_core.engine_args import add_config_args, parse_full_layers
from sparse_core.eval import calibrate as cal
from sparse_core.eval import layer_budgets as lb
from sparse_core.eval.report import markdown_table, plot, settings_table, summarize
from sparse_core.eval.runner import (
    QUERY_AWARE,
    QUERY_SETTINGS,
    EvalConfig,
    RunSettings,
    SampleResult,
    as_dicts,
    run_suite,
)
from sparse_core.eval.tasks import TASKS, Sample, TaskBuilder
from sparse_core.models.loader import load_model_source, model_name
from sparse_core.policy import (
    budget_profile_dirs,
    load_profile,
    new_profile_path,
    profile_path,
    ratios_compression,
)

QUANTIZATION_SETTINGS = ("quantization", "kv_cache_dtype")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _common_args(p: argparse.ArgumentParser, samples: int, seed: int) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {TASKS}")
    p.add_argument("--lengths", default="1000,2000,4000", help="prompt lengths in tokens")
    p.add_argument("--samples", type=int, default=samples, help="samples per task and length")
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="prompt tokens prefilled per step"
    )
    # The number formats of the engine, as `kvsparse serve` takes them: accuracy with FP8.
    add_config_args(p, only=QUANTIZATION_SETTINGS)
    p.add_argument("--json", default=None, help="write every sample's result here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--plot", default=None, help="write the PNG plot here")


def add_eval_subcommands(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="long-context accuracy of sparsity policies (offline tasks)")
    _common_args(ev, samples=10, seed=0)
    ev.add_argument(
        "--settings",
        default=",".join(QUERY_SETTINGS),
        help="comma-separated query settings: the question in the prompt (query-aware), or fed "
        "after the context was compressed (query-agnostic)",
    )
    ev.add_argument("--policies", default=",".join(POLICIES))
    ev.add_argument("--ratios", default="2,4,8,16", help="nominal compressions of the prompt")
    ev.add_argument("--full-layers", default="0", help="N, a,b,c or auto (the calibrated set)")
    ev.add_argument(
        "--match-effective",
        action="store_true",
        help="budgets that make the compression over all layers (full ones too) equal the ratio",
    )
    ev.add_argument(
        "--profile-comparison",
        action="store_true",
        help="instead of the policy grid: calibrate's comparison of layer profiles (dense, "
        "uniform, first 3 full, calibrated, random on the calibrated layers) at equal effective "
        "compression, at each of --ratios",
    )
    ev.add_argument(
        "--layer-budgets",
        choices=["auto"],
        default=None,
        help="every compressing policy at every ratio with the model's calibrated per-layer "
        "budgets for that compression (instead of --full-layers)",
    )
    ev.add_argument(
        "--budget-comparison",
        action="store_true",
        help="instead of the policy grid: calibrated per-layer budgets beside uniform SnapKV, "
        "the binary profile (where it reaches the ratio), PyramidKV, StreamingLLM and random "
        "selection on the same budgets, at each of --ratios (effective compressions)",
    )
    ev.add_argument(
        "--results",
        default=None,
        help="run nothing: write the tables and plot of a JSON file made by --json",
    )
    ev.set_defaults(func=cmd_eval)

    ca = sub.add_parser(
        "calibrate",
        help="find the layers to keep whole, or with --target-compression a budget for every "
        "layer; write a profile",
    )
    _common_args(ca, samples=6, seed=1)  # seed 1: calibrate on other samples than eval's
    ca.add_argument("--ratio", type=float, default=8.0, help="compression of the probed layers")
    ca.add_argument("--band-size", type=int, default=3)
    ca.add_argument("--num-full", type=int, default=10, help="layers the profile keeps whole")
    ca.add_argument(
        "--compare-ratios",
        default="2",
        help="effective compressions to compare profiles at after calibrating (empty: none)",
    )
    ca.add_argument("--compare-seed", type=int, default=0, help="samples of the comparison")
    ca.add_argument(
        "--profile",
        default=None,
        help="profile path (default: <model>.json in $KVSPARSE_PROFILE_DIR where set, else "
        "with the shipped ones)",
    )
    ca.add_argument(
        "--skip-existing",
        action="store_true",
        help="do nothing if the model has a calibrated profile already (--profile, else where "
        "engines look), before loading anything: an install step (full-layer profiles only)",
    )
    ca.add_argument(
        "--target-compression",
        default=None,
        help="effective compressions over all layers (comma-separated): calibrate a budget for "
        "every layer for each, from one sensitivity measurement, and write one profile each",
    )
    ca.add_argument(
        "--levels",
        default="2,4,8,16",
        help="with --target-compression: the budget tiers, as ratios (a layer keeps length / r "
        "tokens); each is one KV pool",
    )
    ca.add_argument(
        "--refine",
        action="store_true",
        help="with --target-compression: measure every band again around each target's "
        "allocation (the other layers compressed as allocated) and re-allocate by that; about "
        "one more probe run per band, level and target",
    )
    ca.add_argument(
        "--profile-dir",
        default=None,
        help="with --target-compression: where the profiles go (default: layer_budgets/<model> "
        "in $KVSPARSE_PROFILE_DIR where set, else with the shipped ones)",
    )
    ca.set_defaults(func=cmd_calibrate)


def _settings(args: argparse.Namespace) -> RunSettings:
    return RunSettings(
        model=args.model,
        window=args.window,
        sinks=args.sinks,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        device=args.device,
        dtype=args.dtype,
        # calibrate: query-aware, the setting of serving
        query_settings=tuple(getattr(args, "settings", QUERY_AWARE).split(",")),
        engine_args={
            "max_num_batched_tokens": args.max_num_batched_tokens,
            **{name: getattr(args, name) for name in QUANTIZATION_SETTINGS},
        },
    )


def _samples(args: argparse.Namespace) -> tuple[list[Sample], object]:
    source = load_model_source(args.model)
    return _build_samples(args, source, args.seed), source


def _build_samples(args: argparse.Namespace, source, seed: int) -> list[Sample]:
    """The suite's prompts for `source`'s tokenizer, drawn with `seed`."""
    builder = TaskBuilder(source.tokenizer, seed=seed)
    limit = source.config.max_position_embeddings - 64  # room for the answer
    return [
        s
        for task in args.tasks.split(",")
        for length in _ints(args.lengths)
        for s in builder.build(task, min(length, limit), args.samples)
    ]


def cmd_eval(args: argparse.Namespace) -> int:
    if args.results:
        results = [SampleResult(**d) for d in json.loads(Path(args.results).read_text())]
        args.json = None  # it is the input
        _write(args, results, f"{args.model}: accuracy vs compression")
        return 0
    settings = _settings(args)  # checks --settings before the model loads
    samples, source = _samples(args)
    if args.profile_comparison:
        full_layers = load_profile(source.config.name)["full_layers"]
        configs = cal.comparison_configs(full_layers, _floats(args.ratios))
        title = f"{args.model}: layer profiles at equal compression"
    elif args.budget_comparison:
        full_layers = load_profile(source.config.name)["full_layers"]
        num_layers = source.config.num_scored_layers
        configs = lb.comparison_configs(_floats(args.ratios), full_layers, num_layers)
        title = f"{args.model}: per-layer budgets at equal effective compression"
    elif args.layer_budgets:
        configs = [
            EvalConfig("dense")
            if policy == "dense"
            else EvalConfig(policy, r, layer_budgets="auto", label=f"{policy}-budgets@{r:g}x")
            for policy in args.policies.split(",")
            for r in ([None] if policy == "dense" else _floats(args.ratios))
        ]
        title = f"{args.model}: calibrated per-layer budgets"
    else:
        full = parse_full_layers(args.full_layers)
        configs = [
            EvalConfig("dense")
            if policy == "dense"
            else EvalConfig(policy, r, full, match_effective=args.match_effective)
            for policy in args.policies.split(",")
            for r in ([None] if policy == "dense" else _floats(args.ratios))
        ]
        title = f"{args.model}: accuracy vs compression"
    results = run_suite(configs, samples, settings, source=source)
    _write(args, results, title)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.target_compression:
        return cmd_calibrate_budgets(args)
    if args.skip_existing:  # before anything loads: an install step on every pod start
        existing = Path(args.profile) if args.profile else profile_path(model_name(args.model))
        if existing is not None and existing.exists():
            _note(f"{args.model} has a calibrated profile already: {existing}")
            return 0
    samples, source = _samples(args)
    num_layers, name = source.config.num_scored_layers, source.config.name
    settings = _settings(args)
    _note(
        f"calibrate {name}: {num_layers} layers in bands of {args.band_size}, "
        f"{len(samples)} prompts, seed {args.seed}"
    )
    sens, probe_results = cal.measure(
        samples, settings, num_layers, args.band_size, args.ratio, source
    )
    full = cal.choose_full_layers(sens, args.num_full)
    for b in sens:
        print(f"layers {b.layers}: damage {b.damage:+.1f}  rescue {b.rescue:+.1f}", file=sys.stderr)
    print(f"full layers: {full}", file=sys.stderr)
    profile = {
        "model": name,
        "full_layers": full,
        "method": (
            f"snapkv at {args.ratio:g}x on bands of {args.band_size} layers; sensitivity = "
            "accuracy lost compressing only the band + accuracy regained keeping only it whole"
        ),
        "sensitivity": [
            {"layers": b.layers, "damage": round(b.damage, 2), "rescue": round(b.rescue, 2)}
            for b in sens
        ],
        "suite": {"tasks": args.tasks, "lengths": args.lengths, "samples": args.samples},
        "seed": args.seed,
        "date": date.today().isoformat(),
        "command": "kvsparse " + shlex.join(sys.argv[1:]),
    }
    path = Path(args.profile) if args.profile else new_profile_path(name)
    _write_atomically(path, json.dumps(profile, indent=2) + "\n")
    print(f"profile written to {path}", file=sys.stderr)
    print(markdown_table(summarize(probe_results)))
    if args.plot:
        cal.plot_sensitivity(
            sens, args.plot, f"{name}: layer-band sensitivity (snapkv {args.ratio:g}x)"
        )
    if args.json:
        Path(args.json).with_suffix(".probe.json").write_text(
            json.dumps(as_dicts(probe_results)) + "\n"
        )
    if args.compare_ratios:
        compare_samples = _build_samples(args, source, args.compare_seed)
        configs = cal.comparison_configs(full, _floats(args.compare_ratios))
        compare = run_suite(configs, compare_samples, settings, source=source)
        _write(args, compare, f"{name}: layer profiles at equal compression", plot_it=False)
    return 0


def _write_atomically(path: Path, text: str) -> None:
    """Write a whole file or none: engines starting beside the writer never read half of one,
    and writers on other pods (a shared volume) each write their own temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(partial, path)


def cmd_calibrate_budgets(args: argparse.Namespace) -> int:
    """Per-layer budgets for each --target-compression from one sensitivity measurement
    (sparse_core/eval/layer_budgets.py says how), then the comparison on other samples."""
    targets, levels = _floats(args.target_compression), _ints(args.levels)
    samples, source = _samples(args)
    num_layers, name = source.config.num_scored_layers, source.config.name
    floor = args.window + args.sinks
    short = min(len(s.prompt_ids) for s in samples)
    too_small = [r for r in levels if round(short / r) <= floor]
    if too_small:
        raise ValueError(
            f"levels {too_small} leave at most window ({args.window}) + sinks ({args.sinks}) "
            f"tokens of the {short}-token probes; probe longer prompts (--lengths) or drop them"
        )
    settings = _settings(args)
    probes = lb.probe_configs(num_layers, args.band_size, levels)
    _note(
        f"calibrate {name}: {len(probes)} probe configs ({num_layers} layers in bands of "
        f"{args.band_size}, levels {levels}) x {len(samples)} prompts, seed {args.seed}"
    )
    probe_results = run_suite(probes, samples, settings, source=source)
    answers = {(s.task, s.length, s.index): s.answers for s in samples}
    damages = lb.measure(probe_results, answers, num_layers, args.band_size, levels)
    for d in damages:
        _note(
            f"layers {cal.span(d.layers)}: damage "
            + "  ".join(f"{r}x {v:.1f}" for r, v in d.damage.items())
        )
    out_dir = Path(args.profile_dir) if args.profile_dir else budget_profile_dirs(name)[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    allocations = {target: lb.allocate(damages, num_layers, target) for target in targets}
    first_pass = {target: ratios for target, (ratios, _) in allocations.items()}
    refinements: dict[float, dict] = {}
    if args.refine:
        allocations, refinements = _refine(
            args.band_size, levels, first_pass, probe_results, answers, samples, settings, source
        )
    chosen = {}
    for target, (ratios, damage) in allocations.items():
        chosen[target] = ratios
        profile = {
            "model": name,
            "target_compression": target,
            "effective_compression": round(ratios_compression(ratios), 3),
            "layer_ratios": list(ratios),
            "levels": levels,
            "method": _budgets_method(args.band_size, target, args.refine),
            "predicted_damage": round(damage, 2),
            "sensitivity": _damage_table(damages),
            **({"refinement": refinements[target]} if args.refine else {}),
            "suite": {"tasks": args.tasks, "lengths": args.lengths, "samples": args.samples},
            "seed": args.seed,
            "date": date.today().isoformat(),
            "command": "kvsparse " + shlex.join(sys.argv[1:]),
        }
        path = out_dir / f"{target:g}x.json"
        _write_atomically(path, json.dumps(profile, indent=2) + "\n")
        _note(f"{target:g}x: layer ratios {list(ratios)} -> {path}")
    compare_samples = _build_samples(args, source, args.compare_seed)
    wanted = ("dense", "budgets@", "uniform@", "random-budgets@")
    configs = [
        c
        for c in lb.comparison_configs(targets, [], num_layers, chosen)
        if c.name.startswith(wanted)
    ]
    # Where the refinement changed an allocation, the first one measured beside it.
    configs += [
        EvalConfig("snapkv", t, layer_budgets=first_pass[t], label=f"first-pass@{t:g}x")
        for t in targets
        if first_pass[t] != chosen[t]
    ]
    _note(f"comparison on {len(compare_samples)} prompts of seed {args.compare_seed}")
    compare = run_suite(configs, compare_samples, settings, source=source)
    _write(args, compare, f"{name}: per-layer budgets at equal compression", plot_it=False)
    if args.json:
        Path(args.json).with_suffix(".probe.json").write_text(
            json.dumps(as_dicts(probe_results)) + "\n"
        )
    return 0


def _refine(
    band_size: int,
    levels: list[int],
    first_pass: dict[float, tuple[int | None, ...]],
    probe_results: list[SampleResult],
    answers: dict[lb.ProbeKey, list[str]],
    samples: list[Sample],
    settings: RunSettings,
    source: object,
) -> tuple[dict[float, tuple[tuple[int | None, ...], float]], dict[float, dict]]:
    """Each target's allocation re-made from measurements around it (layer_budgets.py, step
    3), all targets in one run: per target the new allocation with its predicted damage, and
    what its profile records of the refinement (its predicted damage, first-order, is bounded
    below by 0)."""
    configs = [
        c
        for target, base in first_pass.items()
        for c in lb.refine_configs(base, band_size, levels, f"{target:g}x")
    ]
    _note(f"refine: {len(configs)} configs around the {len(first_pass)} allocations")
    results = probe_results + run_suite(configs, samples, settings, source=source)
    allocations, records = {}, {}
    for target, base in first_pass.items():
        tag = f"{target:g}x"
        changes, at_base = lb.measure_around(results, answers, base, band_size, levels, tag)
        ratios, change = lb.allocate(changes, len(base), target)
        allocations[target] = (ratios, max(0.0, at_base + change))
        records[target] = {
            "operating_point": list(base),
            "damage_at_operating_point": round(at_base, 2),
            "changes": _damage_table(changes),
        }
        _note(f"{tag}: damage {at_base:.1f} at the first allocation; changes from it:")
        for d in changes:
            _note(
                f"  layers {cal.span(d.layers)}: "
                + "  ".join(f"{_option(r)} {v:+.1f}" for r, v in d.damage.items())
            )
    return allocations, records


def _budgets_method(band_size: int, target: float, refined: bool) -> str:
    """How a per-layer budget profile was made, as its file records it."""
    method = (
        f"snapkv; per band of {band_size} layers, divergence from dense's answer (up to its "
        f"last expected answer, probes dense answers) with only the band compressed at each "
        f"level; levels chosen by exact knapsack minimising summed divergence under {target:g}x"
    )
    if refined:
        method += (
            "; then every band measured again at each option with the other layers as so "
            "allocated, and re-allocated by the change of divergence"
        )
    return method


def _damage_table(damages: list[lb.BandDamage]) -> list[dict]:
    """The profile's record of a damage table: per band, level ("2", ...; "whole") -> points."""
    return [
        {
            "layers": d.layers,
            "damage": {
                ("whole" if r is None else str(r)): round(v, 2) for r, v in d.damage.items()
            },
        }
        for d in damages
    ]


def _option(level: int | None) -> str:
    return "whole" if level is None else f"{level}x"


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _write(args: argparse.Namespace, results: list, title: str, plot_it: bool = True) -> None:
    rows = summarize(results)
    text = (
        markdown_table(rows) + "\n\nBy task:\n\n" + markdown_table(summarize(results, "task"), "")
    )
    if len({r.setting for r in rows}) > 1:
        text = settings_table(rows) + "\n\nBy length:\n\n" + text
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(as_dicts(results)) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot and plot_it:
        plot(rows, args.plot, title)

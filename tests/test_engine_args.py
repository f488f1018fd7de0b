"""Every EngineConfig and SparsityConfig field reaches the engine from `kvsparse serve`,
`kvsparse generate`, `kvsparse bench throughput` and a Ray Serve config (the Helm chart's values:
tests/deploy/test_chart.py): each is set to a value other than its default there, through the
real parsers, and read back from the configs the command builds."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from service.cli import build_parser
from service.ray_app import RayAppConfig
from service.serve import serving_configs
from sparse_core.bench.throughput import run_configs
from sparse_core.bench.workload import calibrated_shape
from sparse_core.config import FP8_IF_SUPPORTED, EngineConfig, SparsityConfig
from sparse_core.engine_args import SETTINGS, Setting, configs_from_args, flag_text
from tests.config_samples import Configs, sample, value_of, with_companions

PARSER = build_parser()


def parse(*argv: str) -> argparse.Namespace:
    return PARSER.parse_args(list(argv))


def serve(flags: list[str]) -> Configs:
    return serving_configs(parse("serve", *flags))


def generate(flags: list[str]) -> Configs:
    return configs_from_args(parse("generate", "hi", *flags))


def bench(flags: list[str]) -> Configs:
    """The first run's configs: --policies snapkv unless the flags choose."""
    policies = [] if "--policies" in flags else ["--policies", "snapkv"]
    _, engine, sparsity = run_configs(parse("bench", "throughput", *policies, *flags))[0]
    return engine, sparsity


COMMANDS: dict[str, Callable[[list[str]], Configs]] = {
    "serve": serve,
    "generate": generate,
    "bench throughput": bench,
}


def flags_for(command: str, setting: Setting, value: Any) -> list[str]:
    if command == "bench throughput" and setting.name == "policy":
        return ["--policies", value]  # one run per entry
    if setting.is_bool:
        return [setting.flag if value else setting.flag.replace("--", "--no-", 1)]
    return [setting.flag, flag_text(value)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.dest)
def test_every_field_is_a_flag_of_every_command(command: str, setting: Setting) -> None:
    read = COMMANDS[command]
    default = value_of(read([]), setting)
    value = sample(setting, default)
    flags = [
        f for s, v in with_companions(setting, value).items() for f in flags_for(command, s, v)
    ]
    got = value_of(read(flags), setting)
    if command == "bench throughput" and setting.name == "target_compression":
        # bench lays --profile-model's calibrated shape for the target onto --model.
        args = parse("bench", "throughput")
        model, window, sinks = args.model, args.window, args.sinks
        expected = calibrated_shape(args.profile_model, value, model, args.input_len, window, sinks)
        assert read(flags)[1].layer_budgets == expected
        return
    assert got == value, f"{command} {' '.join(flags)}: {setting.name} is {got!r}"


def ray(engine: dict[str, Any], sparsity: dict[str, Any]) -> Configs:
    model = engine.pop("model", RayAppConfig.model)
    cfg = RayAppConfig.from_dict({"model": model, "engine": engine, "sparsity": sparsity})
    return cfg.engine_config(), cfg.sparsity_config()


# The same settings as `kvsparse serve` flags, and as a Serve config's engine and sparsity.
SERVER_SETTINGS = [
    ([], {}, {}),
    (["--model", "dummy:tiny", "--max-num-seqs", "8"], {"model": "dummy:tiny", "max_num_seqs": 8}, {}),
    (["--policy", "pyramid", "--budget", "256"], {}, {"policy": "pyramid", "budget": 256}),
    (["--policy", "dense", "--max-model-len", "2048"], {"max_model_len": 2048}, {"policy": "dense"}),
    (["--full-layers", "auto", "--no-space-admissions"], {"space_admissions": False},
     {"full_layers": "auto"}),
    (["--quantization", "none", "--kv-cache-dtype", "auto"],
     {"quantization": None, "kv_cache_dtype": "auto"}, {}),
    (["--quantization", "fp8"], {"quantization": "fp8"}, {}),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "engine", "sparsity"), SERVER_SETTINGS)
def test_every_server_entry_point_resolves_the_same_configuration(
    flags: list[str], engine: dict[str, Any], sparsity: dict[str, Any]
) -> None:
    """`kvsparse serve`, a Serve config written by hand (the Helm chart's kind) and `kvsparse
    serve --ray` (which hands its resolved configs on as a Serve config) serve the same engine
    and sparsity from the same settings: what they leave unset, a server's defaults fill. The
    Python API (`LLM(model, sparsity=SparsityConfig(...))`) resolves the same sparsity; its
    engine takes EngineConfig's defaults where a server's differ (docs/serving.md)."""
    from_flags = serve(flags)
    assert SparsityConfig(**sparsity) == from_flags[1]
    assert ray(dict(engine), dict(sparsity)) == from_flags
    resolved_engine, resolved_sparsity = (dataclasses.asdict(c) for c in from_flags)
    assert ray(resolved_engine, resolved_sparsity) == from_flags


@pytest.mark.parametrize("as_text", [False, True], ids=["values", "strings"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.dest)
def test_every_field_is_a_ray_serve_config_field(setting: Setting, as_text: bool) -> None:
    """As YAML gives them, or as strings (Helm's --set, an environment variable in a config)."""
    default = value_of(ray({}, {}), setting)
    value = sample(setting, default)
    mappings: dict[type, dict[str, Any]] = {EngineConfig: {}, SparsityConfig: {}}
    for s, v in with_companions(setting, value).items():
        mappings[s.config][s.name] = flag_text(v) if as_text else v
    got = value_of(ray(mappings[EngineConfig], mappings[SparsityConfig]), setting)
    assert got == value


def test_an_unknown_serve_config_field_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown engine field\(s\) \['max_seqs'\].*max_num_seqs"):
        RayAppConfig(engine={"max_seqs": 4}).engine_config()
    with pytest.raises(ValueError, match=r"unknown sparsity field\(s\) \['budgets'\]"):
        RayAppConfig(sparsity={"budgets": 4}).sparsity_config()
    with pytest.raises(ValueError, match="budget: 'many' is not an integer"):
        RayAppConfig(sparsity={"budget": "many"}).sparsity_config()


def config_actions(command: list[str]) -> list[argparse.Action]:
    subparser = PARSER
    for name in command:
        (sub,) = [a for a in subparser._actions if isinstance(a, argparse._SubParsersAction)]
        subparser = sub.choices[name]
    dests = {s.dest for s in SETTINGS}
    return [a for a in subparser._actions if a.dest in dests]


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["bench", "throughput"]])
def test_help_is_one_line_per_field_with_the_default_the_flag_has(command: list[str]) -> None:
    for action in config_actions(command):
        assert action.help and "\n" not in action.help, action.dest
        if action.default is not None:
            # The value, then what a command's computed default comes to, if it says.
            assert f"(default: {flag_text(action.default)}" in action.help, action.help


def test_every_field_has_a_description():
    for config in (EngineConfig, SparsityConfig):
        for f in dataclasses.fields(config):
            assert f.metadata.get("help"), f"{config.__name__}.{f.name} has no description"


def test_commands_keep_their_own_defaults():
    serve_engine, serve_sparsity = serve([])
    assert serve_engine.space_admissions and serve_engine.max_num_batched_tokens == 4000
    # FP8 weights and KV cache where the GPU has FP8 tensor cores; the library keeps vLLM's.
    assert serve_engine.quantization == serve_engine.kv_cache_dtype == FP8_IF_SUPPORTED
    generate_engine, _ = generate([])
    assert (generate_engine.quantization, generate_engine.kv_cache_dtype) == (None, "auto")
    assert serve_sparsity.policy == "snapkv"
    engine, _ = bench([])
    assert (engine.model, engine.max_num_seqs, engine.max_model_len) == (
        "dummy:llama3-8b",
        256,
        4608,
    )
    engine, _ = bench(["--input-len", "1000", "--output-len", "100"])
    assert engine.expected_input_len == 1000
    engine, sparsity = generate(["--model", "dummy:tiny"])
    assert not engine.space_admissions and sparsity.full_layers is None  # the engine resolves it


# The engine and sparsity flags the commands had before they were generated.
OLD_FLAGS = [
    "--model",
    "--max-num-seqs",
    "--max-model-len",
    "--max-num-batched-tokens",
    "--enable-chunked-prefill",
    "--space-admissions",
    "--block-size",
    "--kv-cache-memory-gb",
    "--gpu-memory-utilization",
    "--gpu-memory-limit-gb",
    "--enforce-eager",
    "--max-prefill-graph-tokens",
    "--async-scheduling",
    "--tensor-parallel-size",
    "-tp",
    "--device",
    "--dtype",
    "--quantization",
    "--kv-cache-dtype",
    "--seed",
    "--step-log",
    "--policy",
    "--budget",
    "--window",
    "--sinks",
    "--full-layers",
    "--pooling",
    "--kernel-size",
    "--layer-budgets",
    "--target-compression",
]


@pytest.mark.parametrize("command", [["serve"], ["generate"]])
def test_the_flags_of_before_keep_their_names(command: list[str]) -> None:
    names = {name for action in config_actions(command) for name in action.option_strings}
    assert set(OLD_FLAGS) <= names
    assert generate(["-tp", "2"])[0].tensor_parallel_size == 2


def test_the_serving_guide_lists_every_flag():
    guide = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
    flags = {
        line.split("|")[1].strip().split(",")[0]
        for line in guide.read_text().splitlines()
        if line.startswith("| `--")
    }
    assert {f"`{s.flag}`" for s in SETTINGS} <= flags


def test_a_bench_run_with_decode_eviction_says_so_in_its_label():
    ((label, _, sparsity),) = run_configs(
        parse("bench", "throughput", "--policies", "snapkv", "--decode-eviction")
    )
    assert sparsity.decode_eviction and label == "snapkv 3 full evict@128 uncapped"

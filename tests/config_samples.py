"""A value other than the default for every EngineConfig and SparsityConfig field: what the tests
of the flags (tests/test_engine_args.py) and of the chart (tests/deploy/test_chart.py) set, to see
each field arrive."""

from __future__ import annotations

from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine_args import SETTINGS, Setting

Configs = tuple[EngineConfig, SparsityConfig]

# Fields whose value has a meaning that the generic rule below would not respect.
SPECIAL: dict[str, Any] = {
    "model": "dummy:tiny",
    "device": "cpu",
    "step_log": "steps.jsonl",
    "hf_overrides": {"rope_theta": 1000.0},
    "full_layers": [0, 2],
    "layer_budgets": [100, None, 90],
    "target_compression": 3.5,
}
# What a field needs set with it to be valid.
COMPANIONS: dict[str, dict[str, Any]] = {"target_compression": {"layer_budgets": "auto"}}


def sample(setting: Setting, default: Any) -> Any:
    """A valid value of the field, not `default`."""
    if setting.name in SPECIAL:
        value = SPECIAL[setting.name]
    elif setting.choices:
        others = [c for c in setting.choices if c != default]
        # An optional field's only choice (quantization fp8, the chart's default): None.
        value = others[0] if others else None
    elif setting.is_bool:
        value = not default
    elif setting.members == (int,):
        value = 48 if default is None else default + 2  # odd stays odd (kernel_size)
    elif setting.members == (float,):
        value = 3.5 if default is None else default / 2
    else:
        raise AssertionError(f"no sample value for {setting.name}: add one to SPECIAL")
    assert value != default, f"the sample of {setting.name} is its default {default!r}"
    return value


def with_companions(setting: Setting, value: Any) -> dict[Setting, Any]:
    """The field's value and those of the fields it needs with it."""
    extra = COMPANIONS.get(setting.name, {})
    by_name = {s.name: s for s in SETTINGS if s.config is setting.config}
    return {setting: value, **{by_name[k]: v for k, v in extra.items()}}


def value_of(configs: Configs, setting: Setting) -> Any:
    engine, sparsity = configs
    return getattr(engine if setting.config is EngineConfig else sparsity, setting.name)

"""Engine and sparsity settings from the command line and from mappings (a Serve config file, the
Helm chart's values), generated from the fields of EngineConfig and SparsityConfig.

Every field is a flag of every command that builds an engine: `--` and its name in kebab case
(vLLM's names: `--max-num-seqs`, `--kv-cache-dtype`, ...), its one-line description (the field's
metadata, sparse_core/config.py) as help, parsed and checked as its type says (a `Literal` gives
the choices, a list is comma-separated, a dict is JSON). A mapping's values go through the same
parsing where they are strings. A new field therefore reaches `kvsparse generate`, `serve`,
`bench throughput`, a Serve config and the chart by itself.

A command that wants another default for a field says so (`add_config_args(defaults=...)`), and
its help shows that default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from sparse_core.config import EngineConfig, SparsityConfig

# Extra names some flags have always had.
FLAG_ALIASES = {"tensor_parallel_size": ("-tp",)}
METAVARS = {"step_log": "PATH", "hf_overrides": "JSON"}


@dataclass(frozen=True)
class Default:
    """A command's own default for a field; `shown`: what the help says it is when the
    command computes it (the value is then None)."""

    value: Any
    shown: str | None = None


@dataclass(frozen=True, eq=False)
class Setting:
    """One field of EngineConfig or SparsityConfig as a flag and as a mapping key."""

    config: type  # EngineConfig or SparsityConfig
    name: str  # the field
    dest: str  # its attribute in parsed arguments (and its flag, in kebab case)
    members: tuple[Any, ...]  # the types the field takes, None aside
    optional: bool  # None is a value
    default: Any  # the field's (for a default factory: what it makes)
    help: str
    shown: str | None  # what a computed default comes to

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The values of a Literal field."""
        if len(self.members) == 1 and typing.get_origin(self.members[0]) is Literal:
            return typing.get_args(self.members[0])
        return None

    @property
    def is_bool(self) -> bool:
        return self.members == (bool,)

    def parse(self, text: str) -> Any:
        """The field's value from its text: a flag's argument, or a string in a mapping."""
        value = _parse(text, self.members, self.optional)
        if value is _INVALID:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}")
        return value

    def value(self, raw: Any) -> Any:
        """A mapping's value for the field: strings are parsed as flags are (a list as
        comma-separated text, a number or a bool as text); anything else is taken as it is."""
        if isinstance(raw, str) and self.members != (str,):
            try:
                return self.parse(raw)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{self.name}: {exc}") from None
        return raw

    def describe(self) -> str:
        return _describe(self.members, self.optional)

    def help_text(self, default: Any, shown: str | None) -> str:
        """Help with the default the flag really has (or what a computed one comes to)."""
        if shown is None and default not in (None, {}, []):
            shown = flag_text(default)
        return self.help if shown is None else f"{self.help} (default: {shown})"


def _describe(members: tuple[Any, ...], optional: bool) -> str:
    names = [_type_name(m) for m in sorted(members, key=lambda m: m is str)]
    return " or ".join(names + (["none"] if optional else []))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"a comma-separated list ({_describe(*_members(item))})"
    if tp is dict or origin is dict:
        return "a JSON object"
    return {int: "an integer", float: "a number", str: "text", bool: "true or false"}[tp]


def flag_text(value: Any) -> str:
    """A value as a flag takes it (also the shown default)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return ",".join("none" if v is None else str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


_INVALID = object()
_BOOLS = {"true": True, "1": True, "yes": True, "on": True}
_BOOLS |= {"false": False, "0": False, "no": False, "off": False}


def _parse(text: str, members: tuple[Any, ...], optional: bool) -> Any:
    """The first of `members` that `text` reads as (text itself last, and never for text with
    a comma where a list is one of them)."""
    if optional and text.strip().lower() in ("none", "null"):
        return None
    listed = "," in text and any(typing.get_origin(m) is list for m in members)
    for tp in sorted(members, key=lambda m: m is str):
        origin = typing.get_origin(tp)
        if origin is Literal:
            if text in typing.get_args(tp):
                return text
        elif origin is list:
            (item,) = typing.get_args(tp)
            item_members, item_optional = _members(item)
            parts = [p.strip() for p in text.strip().strip("[]").split(",") if p.strip()]
            items = [_parse(p, item_members, item_optional) for p in parts]
            if parts and _INVALID not in items:
                return items
        elif tp is dict or origin is dict:
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
        elif tp is bool:
            if text.strip().lower() in _BOOLS:
                return _BOOLS[text.strip().lower()]
        elif tp in (int, float):
            try:
                return tp(text)
            except ValueError:
                continue
        elif tp is str and not listed:
            return text
    return _INVALID


def _members(tp: Any) -> tuple[tuple[Any, ...], bool]:
    """The types a field takes, without None, and whether None is one."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        return tuple(a for a in args if a is not type(None)), type(None) in args
    return (tp,), False


def _settings(config: type, taken: set[str]) -> list[Setting]:
    hints = typing.get_type_hints(config)
    settings = []
    for f in dataclasses.fields(config):
        members, optional = _members(hints[f.name])
        missing = f.default is dataclasses.MISSING
        default = f.default_factory() if missing else f.default  # type: ignore[misc]
        prefix = config.__name__.removesuffix("Config").lower()  # "sparsity_seed"
        dest = f"{prefix}_{f.name}" if f.name in taken else f.name
        settings.append(
            Setting(
                config,
                f.name,
                dest,
                members,
                optional,
                default,
                f.metadata.get("help", ""),
                f.metadata.get("shown"),
            )
        )
    return settings


ENGINE_SETTINGS = tuple(_settings(EngineConfig, set()))
SPARSITY_SETTINGS = tuple(_settings(SparsityConfig, {s.name for s in ENGINE_SETTINGS}))
SETTINGS = ENGINE_SETTINGS + SPARSITY_SETTINGS
BY_DEST = {s.dest: s for s in SETTINGS}


def add_config_args(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, Any | Default] | None = None,
    exclude: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """Every EngineConfig and SparsityConfig field as a flag, in an "engine" and a "sparsity"
    group. `defaults`: the command's own defaults, by flag dest (the field's name; a sparsity
    field that shares an engine field's name is `sparsity_<name>`), as values or `Default`s.
    `exclude`: dests the command sets its own way (`bench throughput`'s `--policies`); `only`:
    just these (a script that varies a few settings)."""
    defaults = dict(defaults or {})
    unknown = sorted({*defaults, *exclude, *(only or ())} - set(BY_DEST))
    if unknown:
        raise ValueError(f"no such engine or sparsity setting: {unknown}")
    groups = {
        EngineConfig: parser.add_argument_group("engine (EngineConfig)"),
        SparsityConfig: parser.add_argument_group("sparsity (SparsityConfig)"),
    }
    for setting in SETTINGS:
        if setting.dest in exclude or (only is not None and setting.dest not in only):
            continue
        given = defaults.get(setting.dest, Default(setting.default, setting.shown))
        if not isinstance(given, Default):
            given = Default(given)
        default = given.value
        if isinstance(default, dict | list):
            default = None  # a fresh one per parse: left out, the field's factory makes it
        kwargs: dict[str, Any] = {"dest": setting.dest, "default": default}
        if setting.is_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif setting.choices:
            # "none" reads as None where the field takes it (--quantization none).
            kwargs["type"] = setting.parse
            kwargs["choices"] = (*setting.choices, None) if setting.optional else setting.choices
            names = [*setting.choices, *(["none"] if setting.optional else [])]
            kwargs["metavar"] = "{" + ",".join(names) + "}"
        else:
            kwargs["type"] = setting.parse
            kwargs["metavar"] = METAVARS.get(setting.name)
        action = groups[setting.config].add_argument(
            setting.flag, *FLAG_ALIASES.get(setting.name, ()), **kwargs
        )
        # Set after: BooleanOptionalAction appends a default of its own on some Pythons.
        action.help = setting.help_text(given.value, given.shown)


def config_values(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The fields of `config` (EngineConfig or SparsityConfig) that the parsed flags set: a
    flag that the command does not have, or a None for a field that takes no None, leaves the
    field to its default."""
    values = {}
    for setting in ENGINE_SETTINGS if config is EngineConfig else SPARSITY_SETTINGS:
        value = getattr(args, setting.dest, None)
        if value is not None or (setting.optional and hasattr(args, setting.dest)):
            values[setting.name] = value
    return values


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, SparsityConfig]:
    """The configs of a command's flags (`add_config_args`)."""
    engine = EngineConfig(**config_values(args, EngineConfig))
    return engine, SparsityConfig(**config_values(args, SparsityConfig))


def parse_full_layers(text: str) -> int | list[int] | str:
    """The text of a --full-layers flag."""
    try:
        return BY_DEST["full_layers"].parse(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--full-layers: {exc}") from None


def config_from_mapping(config: type, values: Mapping[str, Any], where: str) -> Any:
    """EngineConfig or SparsityConfig from a mapping of its fields (a Serve config's `engine`
    or `sparsity`, the chart's values), strings parsed as their flags are."""
    settings = {s.name: s for s in SETTINGS if s.config is config}
    unknown = sorted(set(values) - set(settings))
    if unknown:
        raise ValueError(f"unknown {where} field(s) {unknown}; known: {sorted(settings)}")
    return config(**{name: settings[name].value(raw) for name, raw in values.items()})

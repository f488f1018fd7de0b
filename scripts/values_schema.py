"""Writes deploy/helm/kvsparse/values.schema.json, the JSON schema `helm install`, `upgrade`,
`template` and `lint` check the chart's values against, so that a mistyped or unknown key fails
there instead of when the application starts on the cluster.

    python3 scripts/values_schema.py          # rewrite it (after changing values.yaml or a config)
    python3 scripts/values_schema.py --check  # exit 1 if it is stale (tests/deploy runs this)

`engine` and `sparsity` come from the same field list as the engine's flags
(sparse_core.engine_args.SETTINGS): every EngineConfig / SparsityConfig field by name, its type,
its help as the description; a string is also accepted where the flag would parse it
(`full_layers: "0,1,2"`). `serve.extraArgs` takes RayAppConfig's fields. The rest follows
values.yaml: its mappings take only the keys it has, except the free-form ones below
(Kubernetes objects, environment maps, labels), and each value's type is its default's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparse_core.engine_args import ENGINE_SETTINGS, SPARSITY_SETTINGS, Setting  # noqa: E402

CHART = ROOT / "deploy" / "helm" / "kvsparse"
SCHEMA = CHART / "values.schema.json"
# Mappings whose keys are the user's (Kubernetes objects and maps passed through as they are).
FREE_FORM = {
    "serve.rayServeEnv", "autoscaling.config", "ncclEnv", "head.rayStartParams",
    "head.resources", "head.nodeSelector", "worker.rayStartParams", "worker.resources",
    "worker.nodeSelector", "worker.affinity", "podSecurityContext", "service.annotations",
    "ingress.annotations", "monitoring.podMonitor.labels", "monitoring.serviceMonitor.labels",
    "monitoring.dashboards.labels", "monitoring.prometheusRule.labels",
}  # fmt: skip
# Values whose default is null, and what they take.
NULLABLE = {
    "serve.maxOngoingRequests": {"type": ["integer", "null"], "minimum": 1},
    "serve.maxInflightRequests": {"type": ["integer", "null"], "minimum": 1},
}
# String values that take one of a few words.
ENUMS = {
    "engineKind": ["native", "vllm"],
    "rayAuth.mode": ["token", "disabled"],
    "service.type": ["ClusterIP", "NodePort", "LoadBalancer"],
    "image.pullPolicy": ["Always", "IfNotPresent", "Never"],
}
# Set from other values (model.path, tensorParallelSize), not in `engine`.
CHART_OWNED_ENGINE_FIELDS = {"model", "tensor_parallel_size"}
JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object"}


def member_schema(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        (item,) = typing.get_args(tp)
        members = typing.get_args(item) if typing.get_origin(item) else (item,)
        types = [JSON_TYPES[m] if m is not type(None) else "null" for m in members]
        return {"type": "array", "items": {"type": types}}
    return {"type": JSON_TYPES[origin or tp]}


def setting_schema(setting: Setting) -> dict[str, Any]:
    """A field's schema: any of its types, null where it is optional, and text where its flag
    would parse it (the chart reads strings as the flags read them)."""
    options = [member_schema(m) for m in setting.members]
    if setting.optional:
        options.append({"type": "null"})
    if not setting.choices and str not in setting.members:
        options.append({"type": "string"})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "description": setting.help}


def config_schema(settings: tuple[Setting, ...], skip: set[str] = frozenset()) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {s.name: setting_schema(s) for s in settings if s.name not in skip},
    }


def value_schema(value: Any, path: str) -> dict[str, Any]:
    """The schema of a value of values.yaml, from its default."""
    if path in NULLABLE:
        return NULLABLE[path]
    if path in ENUMS:
        return {"enum": ENUMS[path]}
    if isinstance(value, dict):
        if path in FREE_FORM:
            return {"type": "object"}
        return {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                key: value_schema(v, f"{path}.{key}" if path else key) for key, v in value.items()
            },
        }
    if isinstance(value, list):
        return {"type": "array"}
    if value is None:
        return {}
    return {"type": JSON_TYPES[type(value)]}


def ray_app_fields() -> list[str]:
    from service.ray_app import RayAppConfig

    return [f.name for f in dataclasses.fields(RayAppConfig)]


def build() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = {"$schema": "https://json-schema.org/draft-07/schema#", **value_schema(values, "")}
    props = schema["properties"]
    props["engine"] = config_schema(ENGINE_SETTINGS, CHART_OWNED_ENGINE_FIELDS)
    props["sparsity"] = config_schema(SPARSITY_SETTINGS)
    props["serve"]["properties"]["extraArgs"] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {name: {} for name in ray_app_fields()},
    }
    return schema


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args()
    text = json.dumps(build(), indent=2) + "\n"
    if args.check:
        if SCHEMA.read_text() != text:
            print(f"{SCHEMA.relative_to(ROOT)} is stale: run scripts/values_schema.py")
            return 1
        return 0
    SCHEMA.write_text(text)
    print(f"wrote {SCHEMA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoints whose linear weights are already in FP8: the compressed-tensors format.

llm-compressor's "FP8-Dynamic" scheme (the usual `*-FP8-Dynamic` checkpoints on the hub) stores
every quantized projection as an e4m3 `weight` (out, in) and a `weight_scale` (out, 1), one
scale per output channel, and has activations quantized per token at run time: exactly what
`EngineConfig.quantization="fp8"` computes (sparse_core/kernels/fp8.py), so the engine loads the
stored tensors as they are, without quantizing again. config.json describes the scheme under
`quantization_config`; anything else it may describe (other bit widths, integer types, static
or per-tensor activation scales, group or block scales, weight-only schemes, other formats,
sparsity, KV cache scales, other quantization methods) is refused here by name, at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparse_core.config import FP8_IF_SUPPORTED, EngineConfig

logger = logging.getLogger(__name__)

METHOD = "compressed-tensors"
FORMAT = "float-quantized"
# What each quantized group must say, per tensor kind (the FP8-Dynamic preset).
_EXPECTED = {
    "weights": {
        "num_bits": 8,
        "type": "float",
        "strategy": "channel",
        "symmetric": True,
        "dynamic": False,
        "group_size": None,
        "block_structure": None,
    },
    "input_activations": {
        "num_bits": 8,
        "type": "float",
        "strategy": "token",
        "symmetric": True,
        "dynamic": True,
        "group_size": None,
        "block_structure": None,
    },
}
SUPPORTED = (
    "pre-quantized FP8-Dynamic checkpoints in the compressed-tensors format (quant_method "
    "'compressed-tensors', format 'float-quantized': 8-bit float weights with one static scale "
    "per output channel, 8-bit float activations with dynamic per-token scales)"
)


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's own quantization, as its config.json describes it."""

    method: str  # "compressed-tensors"
    scheme: str  # "FP8-Dynamic"
    ignore: tuple[str, ...]  # modules the checkpoint keeps unquantized (e.g. lm_head)
    quantization: str = "fp8"  # the EngineConfig.quantization that computes it

    def describe(self) -> str:
        return f"{self.method} {self.scheme}"


def parse_quantization_config(
    config: dict[str, Any] | None, where: str
) -> CheckpointQuantization | None:
    """The checkpoint quantization of a config.json's `quantization_config` (None: none);
    ValueError naming every setting the engine does not support."""
    if config is None:
        return None
    method = config.get("quant_method")
    if method != METHOD:
        raise ValueError(
            f"{where}: checkpoint quantization {method!r} is not supported; supported: "
            f"{SUPPORTED}, or an unquantized checkpoint (--quantization fp8 then quantizes it "
            "at load)"
        )
    problems = []
    if config.get("format") != FORMAT:
        problems.append(f"format {config.get('format')!r} (supported: {FORMAT!r})")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        problems.append(f"quantization_status {status!r} (supported: 'compressed')")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme", "moe_sparsity_config"):
        if config.get(key):
            problems.append(f"{key} {config[key]!r} (supported: none)")
    groups = config.get("config_groups") or {}
    if not groups:
        problems.append("no config_groups")
    for name, group in groups.items():
        if group.get("format") not in (None, FORMAT):
            problems.append(f"group {name!r}: format {group['format']!r} (supported: {FORMAT!r})")
        if group.get("output_activations"):
            problems.append(f"group {name!r}: output_activations quantized (supported: none)")
        for kind, expected in _EXPECTED.items():
            args = group.get(kind)
            if not args:
                missing = "weight-only quantization" if kind == "input_activations" else "none"
                problems.append(f"group {name!r}: {kind} not quantized ({missing})")
                continue
            wrong = [
                f"{key} {args.get(key)!r} (supported: {value!r})"
                for key, value in expected.items()
                if args.get(key, value if value is None else "unset") != value
            ]
            if wrong:
                problems.append(f"group {name!r} {kind}: {', '.join(wrong)}")
    if problems:
        raise ValueError(
            f"{where}: unsupported compressed-tensors quantization: {'; '.join(problems)}. "
            f"Supported: {SUPPORTED}"
        )
    return CheckpointQuantization(METHOD, "FP8-Dynamic", tuple(config.get("ignore") or ()))


def read_checkpoint_quantization(model: str) -> CheckpointQuantization | None:
    """The quantization of the checkpoint that `model` names, read from its config.json alone
    (no weights): None for a model that is not a Hugging Face directory or not quantized."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        return None
    hf = json.loads(path.read_text())
    return parse_quantization_config(hf.get("quantization_config"), str(path.parent))


def describe_checkpoint_quantization(model: str) -> str | None:
    """E.g. "compressed-tensors FP8-Dynamic" for a pre-quantized checkpoint, else None."""
    checkpoint = read_checkpoint_quantization(model)
    return None if checkpoint is None else checkpoint.describe()


def resolve_quantization(
    config: EngineConfig, checkpoint: CheckpointQuantization | None
) -> EngineConfig:
    """`config` with the quantization that the checkpoint's own implies. As in vLLM, a
    pre-quantized checkpoint sets it when `quantization` is unset (or "fp8_if_supported", the
    servers' default); "fp8" with an FP8-Dynamic checkpoint is the same computation (its stored
    weights and scales are loaded, not quantized again); another setting is refused."""
    if checkpoint is None:
        return config
    if config.quantization in (None, FP8_IF_SUPPORTED):
        logger.info(
            "%s: pre-quantized %s checkpoint: quantization=%r (the stored FP8 weights and "
            "scales, as they are)",
            config.model,
            checkpoint.describe(),
            checkpoint.quantization,
        )
        return dataclasses.replace(config, quantization=checkpoint.quantization)
    if config.quantization != checkpoint.quantization:
        raise ValueError(
            f"quantization={config.quantization!r} conflicts with the checkpoint's own "
            f"({checkpoint.describe()}, computed as quantization={checkpoint.quantization!r}); "
            "leave quantization unset to use the checkpoint's"
        )
    logger.info(
        "%s: pre-quantized %s checkpoint: its FP8 weights and scales are loaded as they are "
        "(not quantized again)",
        config.model,
        checkpoint.describe(),
    )
    return config

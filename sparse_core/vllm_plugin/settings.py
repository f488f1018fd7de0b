"""The plugin's settings: vLLM's `additional_config["kvsparse"]`, else `KVSPARSE_VLLM_CONFIG`.

Both hold the same dictionary: the fields of `SparsityConfig` plus `model_name` (the name of the
calibrated profile that `full_layers="auto"` and `layer_budgets="auto"` load; default: the model
directory's name) and `expected_input_len` (the typical prompt, which `layer_budgets="auto"`
sizes its budgets for; default: EngineConfig's). With neither set, or with settings that
compress no layer of the model (policy "dense", or every layer whole), the plugin stays out of
the way and vLLM runs exactly as without it: its own attention backend and KV cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.policy import LayerPlan, plan_layers

CONFIG_KEY = "kvsparse"
ENV_VAR = "KVSPARSE_VLLM_CONFIG"


@dataclass(frozen=True)
class PluginSettings:
    sparsity: SparsityConfig
    model_name: str | None = None
    expected_input_len: int = EngineConfig.expected_input_len

    def layer_plan(self, num_layers: int, model_path: str) -> LayerPlan:
        name = self.model_name or Path(model_path).name
        return plan_layers(self.sparsity, num_layers, name).at_length(self.expected_input_len)

    def compresses(self, model_config: Any) -> bool:
        """Whether any layer of vLLM's model (its `model_config`) keeps a budget. A model with
        sliding-window layers is refused: the plugin's plan does not know them."""
        text = model_config.hf_text_config
        if getattr(text, "sliding_window", None) and "sliding_attention" in (
            getattr(text, "layer_types", None) or []
        ):
            raise ValueError(
                f"{model_config.model}: models with sliding-window layers (Gemma 3) are not "
                "supported by kvsparse's vLLM plugin; serve them with the native engine "
                "(--engine native)"
            )
        plan = self.layer_plan(text.num_hidden_layers, model_config.model)
        return plan.compresses


def parse_settings(raw: dict[str, Any] | str | None) -> PluginSettings | None:
    """Settings from a dictionary (or its JSON text); None means the plugin is off."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"kvsparse settings are not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"kvsparse settings must be a dictionary, got {type(raw).__name__}")
    options = dict(raw)
    model_name = options.pop("model_name", None)
    input_len = options.pop("expected_input_len", EngineConfig.expected_input_len)
    sparsity = SparsityConfig.from_dict(options)
    if sparsity.decode_eviction:
        raise ValueError(
            "decode_eviction is not supported by the vLLM plugin (vLLM's KV cache specs append "
            "every decoded token); use the native engine (--engine native) for it"
        )
    return PluginSettings(sparsity, model_name, input_len)


def settings_from_vllm_config(vllm_config: Any) -> PluginSettings | None:
    """The settings of the engine being configured: additional_config first, then the env; None
    (the plugin off) without them or when they compress no layer of its model."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(additional, dict) and CONFIG_KEY in additional:
        settings = parse_settings(additional[CONFIG_KEY])
    else:
        settings = parse_settings(os.environ.get(ENV_VAR))
    model_config = getattr(vllm_config, "model_config", None)
    if settings is not None and model_config is not None and not settings.compresses(model_config):
        return None
    return settings


def current_settings() -> PluginSettings | None:
    """The settings of the vLLM config being built, which vLLM sets while it picks attention
    backends and builds layers; outside one (no model known) the environment's, as given."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return parse_settings(os.environ.get(ENV_VAR))
    return settings_from_vllm_config(config)

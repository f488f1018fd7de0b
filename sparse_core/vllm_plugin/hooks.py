"""Where the plugin attaches to vLLM. Each hook does nothing unless kvsparse settings are given.

- the platform's `get_attn_backend_cls`: our backend for decoder attention (on CPU vLLM would
  otherwise always pick its own);
- the platform's `check_and_update_config`: whole prompts per step (no chunked prefill) and no
  prefix caching, which compaction needs, and a KV cache dtype the backend stores;
- the platform's `register_custom_kv_cache_specs`, vLLM's seam for custom specs: our spec and
  manager go into its KV-cache spec registry;
- `Attention.get_kv_cache_spec`: the layer-to-spec mapping. vLLM asks each attention layer for its
  spec, and the backend's own hook (`customize_spec`) is not told which layer it is, so the
  layer's answer is where a sparse layer can get the budget spec.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from sparse_core.vllm_plugin.settings import current_settings, settings_from_vllm_config

BACKEND_PATH = "sparse_core.vllm_plugin.attention.KVSparseAttentionBackend"
logger = logging.getLogger("kvsparse.vllm_plugin")


def install() -> None:
    from vllm.model_executor.layers.attention import Attention
    from vllm.platforms import current_platform

    from sparse_core.vllm_plugin.compat import register_backend

    platform = type(current_platform)
    if getattr(platform, "_kvsparse_installed", False):
        return
    # Layers look their backend up by name in vLLM's backend registry.
    register_backend(BACKEND_PATH)
    _wrap_classmethod(platform, "get_attn_backend_cls", _select_backend)
    _wrap_classmethod(platform, "check_and_update_config", _update_config)
    _wrap_classmethod(platform, "register_custom_kv_cache_specs", _register_specs)
    original_spec = Attention.get_kv_cache_spec

    @functools.wraps(original_spec)
    def get_kv_cache_spec(self, vllm_config):
        return _layer_spec(self, vllm_config, original_spec(self, vllm_config))

    Attention.get_kv_cache_spec = get_kv_cache_spec
    platform._kvsparse_installed = True


def _wrap_classmethod(cls: type, name: str, hook) -> None:
    original = getattr(cls, name)  # bound to cls

    def wrapper(klass, *args, **kwargs):
        return hook(original, *args, **kwargs)

    setattr(cls, name, classmethod(functools.wraps(original)(wrapper)))


def _select_backend(original, selected_backend, attn_selector_config, *args, **kwargs) -> str:
    default = original(selected_backend, attn_selector_config, *args, **kwargs)
    if current_settings() is None:
        return default
    c = attn_selector_config
    if c.use_mla or c.use_sparse or c.attn_type != "decoder":
        return default
    return BACKEND_PATH


def _update_config(original, vllm_config, *args, **kwargs) -> Any:
    result = original(vllm_config, *args, **kwargs)
    settings = settings_from_vllm_config(vllm_config)
    if settings is None or vllm_config.model_config is None:
        return result
    from sparse_core.vllm_plugin.attention import KVSparseAttentionBackend

    scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
    supported = KVSparseAttentionBackend.supported_kv_cache_dtypes
    if cache.cache_dtype not in supported:
        raise ValueError(
            f"kvsparse: kv_cache_dtype {cache.cache_dtype!r} is not supported with sparse layers; "
            f"use one of {', '.join(supported)}"
        )
    if getattr(cache, "calculate_kv_scales", False):  # vLLM 0.24's, deprecated there
        raise ValueError("kvsparse: calculate_kv_scales is not supported with sparse layers")
    if scheduler.enable_chunked_prefill or cache.enable_prefix_caching:
        logger.info("kvsparse: chunked prefill and prefix caching are off (whole prompts)")
    scheduler.enable_chunked_prefill = False
    cache.enable_prefix_caching = False
    max_len = vllm_config.model_config.max_model_len
    scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, max_len)
    return result


def _register_specs(original, *args, **kwargs) -> Any:
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from sparse_core.vllm_plugin.kv_spec import BudgetAttentionManager, BudgetAttentionSpec

    result = original(*args, **kwargs)
    KVCacheSpecRegistry.register(BudgetAttentionSpec, BudgetAttentionManager)
    return result


def _layer_spec(layer, vllm_config, spec):
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from sparse_core.vllm_plugin.attention import KVSparseAttentionBackend
    from sparse_core.vllm_plugin.kv_spec import BudgetAttentionSpec

    settings = settings_from_vllm_config(vllm_config)
    if settings is None or type(spec) is not FullAttentionSpec:
        return spec
    if layer.attn_backend is not KVSparseAttentionBackend:
        return spec
    model = vllm_config.model_config
    plan = settings.layer_plan(model.hf_text_config.num_hidden_layers, model.model)
    budget = plan.groups[plan.layer_to_group[extract_layer_index(layer.layer_name)]].budget
    if budget is None:
        return spec
    # Every field the budget spec shares with the layer's spec (they differ between releases).
    fields = {
        f.name: getattr(spec, f.name)
        for f in dataclasses.fields(BudgetAttentionSpec)
        if f.init and f.name != "budget" and hasattr(spec, f.name)
    }
    return BudgetAttentionSpec(**fields, budget=budget)

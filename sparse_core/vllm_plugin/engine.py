"""Start stock vLLM with the plugin configured from a `SparsityConfig` (tests, eval, serving)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparse_core.config import SparsityConfig
from sparse_core.models.loader import BUILTIN_MODELS
from sparse_core.vllm_plugin.hf_export import export_hf_dir
from sparse_core.vllm_plugin.settings import CONFIG_KEY


def vllm_model_path(model: str) -> str:
    """A path vLLM can load: built-in aliases and GGUF files become a Hugging Face directory."""
    if model in BUILTIN_MODELS or model.endswith(".gguf"):
        return str(export_hf_dir(model))
    return model


def plugin_config(
    sparsity: SparsityConfig | None,
    model_name: str | None = None,
    expected_input_len: int | None = None,
) -> dict:
    """vLLM's `additional_config` for these settings; {} leaves the plugin off."""
    if sparsity is None:
        return {}
    options: dict[str, Any] = dataclasses.asdict(sparsity)
    if model_name is not None:
        options["model_name"] = model_name
    if expected_input_len is not None:
        options["expected_input_len"] = expected_input_len
    return {CONFIG_KEY: options}


@contextmanager
def vllm_llm(
    model: str,
    sparsity: SparsityConfig | None,
    expected_input_len: int | None = None,
    **engine_args: Any,
) -> Iterator[Any]:
    """A `vllm.LLM` running `model` with kvsparse's `sparsity` (None: stock vLLM), shut down on
    exit. The model's name (the alias, or the file's stem) picks its calibrated profile;
    `expected_input_len` sizes layer_budgets="auto"."""
    from vllm import LLM

    name = model if model in BUILTIN_MODELS else Path(model).stem
    llm = LLM(
        model=vllm_model_path(model),
        additional_config=plugin_config(sparsity, name, expected_input_len),
        **engine_args,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()

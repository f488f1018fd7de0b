"""Start stock vLLM with the plugin configured from a `SparsityConfig` (tests, eval, serving)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparse_core.config import SparsityConfig
from sparse_core.models.loader import BUILTIN_MODELS
from sparse_core.vllm_plugin.hf_export import CACHE_DIR, export_hf_dir
from sparse_core.vllm_plugin.settings import CONFIG_KEY


def vllm_model_path(model: str) -> str:
    """A path vLLM can load: built-in aliases, GGUF files and dummy models become a Hugging Face
    directory (a dummy model's holds its config alone)."""
    if model in BUILTIN_MODELS or model.endswith(".gguf") or model.startswith("dummy:"):
        return str(export_hf_dir(model))
    return model


def dummy_model_args(model: str) -> dict[str, Any]:
    """vLLM's engine arguments for a `dummy:<preset>` model: random weights and no tokenizer
    (token ids in and out); none for other models."""
    if model.startswith("dummy:"):
        return {"load_format": "dummy", "skip_tokenizer_init": True}
    return {}


def ensure_entry_point() -> None:
    """vLLM finds the plugin through the installed package's entry point, in each process it
    starts. A checkout that is only on PYTHONPATH (not pip-installed, as on a benchmark machine)
    has no package record: write a minimal one and put its directory on sys.path and on the
    PYTHONPATH that vLLM's processes inherit."""
    from importlib.metadata import entry_points

    if any(ep.name == "kvsparse" for ep in entry_points(group="vllm.general_plugins")):
        return
    root = CACHE_DIR / "entry-point"
    record = root / "kvsparse-0+checkout.dist-info"
    record.mkdir(parents=True, exist_ok=True)
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: kvsparse\nVersion: 0+checkout\n")
    (record / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvsparse = sparse_core.vllm_plugin:register\n"
    )
    sys.path.append(str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), str(root)])
    )


def profile_name(model: str) -> str:
    """The name a model's calibrated profiles are filed under: the alias, else the file's or
    directory's stem."""
    return model if model in BUILTIN_MODELS else Path(model).stem


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
    `expected_input_len` sizes layer_budgets="auto". A `dummy:<preset>` model runs on random
    weights and takes token ids only."""
    ensure_entry_point()
    from vllm import LLM

    llm = LLM(
        model=vllm_model_path(model),
        additional_config=plugin_config(sparsity, profile_name(model), expected_input_len),
        **{**dummy_model_args(model), **engine_args},
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()

"""kvsparse engine: layer-wise KV-cache sparsity for long-prompt LLM serving.

The engine's names are imported on first use (PEP 562), so that the vocabulary below it
(`sparse_core.config`, `sparse_core.sampling_params`, `sparse_core.outputs`) stays
importable without torch: the Ray ingress speaks it and never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparse_core.config import EngineConfig, SparsityConfig
    from sparse_core.engine.async_engine import AsyncLLM
    from sparse_core.engine.llm import LLM
    from sparse_core.engine.llm_engine import LLMEngine
    from sparse_core.outputs import RequestOutput
    from sparse_core.sampling_params import SamplingParams

_MODULES = {
    "LLM": "sparse_core.engine.llm",
    "AsyncLLM": "sparse_core.engine.async_engine",
    "EngineConfig": "sparse_core.config",
    "LLMEngine": "sparse_core.engine.llm_engine",
    "RequestOutput": "sparse_core.outputs",
    "SamplingParams": "sparse_core.sampling_params",
    "SparsityConfig": "sparse_core.config",
}
__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SparsityConfig",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'sparse_core' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)

"""kvsparse engine: layer-wise KV-cache sparsity for long-prompt LLM serving."""

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.async_engine import AsyncLLM
from sparse_core.engine.llm import LLM
from sparse_core.engine.llm_engine import LLMEngine
from sparse_core.engine.outputs import RequestOutput
from sparse_core.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SparsityConfig",
]

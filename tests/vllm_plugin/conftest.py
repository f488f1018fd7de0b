"""The vLLM tier: stock vLLM (CPU build) with the plugin, on the built-in SmolLM2.

These tests need vLLM, which lives in its own environment (`make test-vllm` builds .venv-vllm
and runs them); without it they skip. vLLM's CPU settings must be in the environment before
vLLM starts its engine processes.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# collective_rpc with a function (the tests read the worker's KV cache groups).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MODEL = "smollm2-135m-instruct"
# block_size: vLLM's CPU build needs a multiple of 32.
ENGINE_ARGS = {
    "enforce_eager": True,
    "gpu_memory_utilization": 0.5,
    "dtype": "float32",
    "block_size": 32,
    "disable_log_stats": False,
}


@pytest.fixture(scope="session")
def model_source():
    from sparse_core.models.loader import load_model_source

    return load_model_source(MODEL)

"""Shared fixtures: the real built-in model (loaded once) and Hugging Face's reference model."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter. It is read when a kernel module is
# imported, so it is set before anything imports ours: a test importing the kernels late would
# otherwise reload one module against helpers compiled for the GPU (tests/triton_setup.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sparse_core import LLM, SparsityConfig
from sparse_core.models.loader import builtin_model_path

# Two-core CI machines: more threads than cores only adds contention.
torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))


@pytest.fixture(scope="session")
def dense_llm() -> LLM:
    """SmolLM2-135M-Instruct, dense, float32 on CPU."""
    return LLM(sparsity=SparsityConfig(policy="dense"), max_model_len=4096, kv_cache_memory_gb=0.5)


@pytest.fixture(scope="session")
def hf_model():
    """transformers loading the same GGUF file: the reference for greedy outputs."""
    from transformers import AutoModelForCausalLM

    path = builtin_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()

"""Shared fixtures: the real built-in model (loaded once) and Hugging Face's reference model."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.triton_setup import use_interpreter_without_cuda

# Before anything imports our modules: Triton reads it as a kernel module is imported.
use_interpreter_without_cuda()

from sparse_core import LLM, SparsityConfig  # noqa: E402
from sparse_core.models.loader import builtin_model_path  # noqa: E402

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


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process once pytest has reported, with its exit status, skipping the
    interpreter's teardown: threads that Ray, gRPC and torch leave behind can crash there after
    every test has passed (a segmentation fault after a green suite, seen on a 2-core machine),
    and nothing of ours runs at that point."""
    status = getattr(config, "_kvsparse_exit_status", None)
    if status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._kvsparse_exit_status = int(exitstatus)

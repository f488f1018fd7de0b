"""Qwen3 (dense) in the native engine: a small random checkpoint saved by transformers, its
greedy tokens equal to transformers' own, dense and with snapkv at a budget above the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.models.loader import load_model_source
from tests.hf_checkpoints import save_checkpoint, tiny_qwen3

PROMPTS = [[5, 17, 42, 99, 3, 250, 77, 8, 120, 64, 31, 200], [9, 9, 140, 33, 7]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """`tiny_qwen3` saved as transformers saves it."""
    model = tiny_qwen3()
    return save_checkpoint(model, tmp_path_factory.mktemp("qwen3")), model


def transformers_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_the_checkpoint_loads_with_its_norms_and_head_dim(checkpoint):
    path, model = checkpoint
    src = load_model_source(str(path))
    assert src.config.qk_norm and src.config.head_dim == 32 and not src.config.attention_bias
    norm = "model.layers.1.self_attn.k_norm.weight"
    assert torch.equal(src.weights[norm], model.state_dict()[norm])


# snapkv's budget is above the prompts, so it keeps every token: the tokens stay transformers'.
SNAPKV = SparsityConfig(policy="snapkv", budget=64, window=4, sinks=2, full_layers=1)


@pytest.mark.parametrize(
    "sparsity", [SparsityConfig(policy="dense"), SNAPKV], ids=["dense", "snapkv"]
)
def test_greedy_tokens_equal_transformers(checkpoint, sparsity):
    path, model = checkpoint
    expected = [transformers_greedy(model, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model=str(path), sparsity=sparsity, dtype="float32", max_model_len=256,
             kv_cache_memory_gb=0.05) as llm:  # fmt: skip
        got = [out.token_ids for out in llm.generate(PROMPTS, params)]
    assert got == expected


def test_the_dummy_preset_has_qwen3_8bs_shape():
    c = DUMMY_PRESETS["qwen3-8b"]
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (36, 32, 8)
    assert c.head_dim == 128 and c.qk_norm and c.vocab_size == 151936

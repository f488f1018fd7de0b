"""Decode eviction (`SparsityConfig.decode_eviction`): a sparse layer holds at most its budget,
the prefill's kept tokens and a ring of the most recent tokens fed after it.

The oracle is transformers' own forward of a small random Llama checkpoint, teacher forced on
the engine's greedy tokens, with every sparse layer's attention restricted to what the engine
holds: with the streamingllm policy the kept prompt tokens are known without scores (the sinks
and the prompt's last ones), and the ring the last `decode_window` fed tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

from sparse_core import LLM, SamplingParams, SparsityConfig
from tests.hf_checkpoints import save_checkpoint

PROMPT_LEN, NEW_TOKENS = 40, 30
WHOLE_LAYERS = [0]
SPARSITY = SparsityConfig(
    policy="streamingllm", budget=20, window=4, sinks=2, full_layers=WHOLE_LAYERS,
    decode_eviction=True, decode_window=6,
)  # fmt: skip
KEPT = 20 - 6  # of the prompt: the budget less the ring; the sinks and the last 12 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Llama with weights large enough for peaked attention, so that a token missing
    from what a layer attends to (or one that should have left it) changes the greedy tokens."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return save_checkpoint(model, tmp_path_factory.mktemp("llama")), model


def held_by_sparse_layers(num_keys: int) -> torch.Tensor:
    """bool [num_keys, num_keys]: the keys a sparse layer's query at each position attends
    to. A prompt query sees every earlier token (the prefill attends before it compresses);
    the i-th token fed after the prompt sees the kept prompt tokens and fed tokens i-5 .. i."""
    n, window = PROMPT_LEN, SPARSITY.decode_window
    q = torch.arange(num_keys).unsqueeze(1)
    k = torch.arange(num_keys).unsqueeze(0)
    kept_prompt = (k < SPARSITY.sinks) | ((k >= n - (KEPT - SPARSITY.sinks)) & (k < n))
    recent = (k >= n) & (k <= q) & (k > q - window)
    return torch.where(q < n, k <= q, kept_prompt | recent)


def teacher_forced_greedy(model: torch.nn.Module, tokens: list[int]) -> list[int]:
    """transformers' greedy choice after every token from the prompt's last on, with the
    sparse layers attending as the engine's decode eviction holds them."""

    def attend(module, query, key, value, attention_mask, **kwargs):
        num_keys = key.shape[2]
        if module.layer_idx in WHOLE_LAYERS:
            allowed = torch.ones(num_keys, num_keys, dtype=torch.bool).tril()
        else:
            allowed = held_by_sparse_layers(num_keys)
        mask = torch.zeros(num_keys, num_keys).masked_fill(~allowed, float("-inf"))
        return eager_attention_forward(module, query, key, value, mask[None, None], **kwargs)

    AttentionInterface.register("decode_eviction_oracle", attend)
    model.config._attn_implementation = "decode_eviction_oracle"
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
    finally:
        model.config._attn_implementation = "eager"
    return logits[PROMPT_LEN - 1 :].argmax(-1).tolist()


def test_greedy_tokens_equal_transformers_attending_only_to_what_the_engine_holds(checkpoint):
    path, model = checkpoint
    prompt = torch.randint(3, 300, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", sparsity=SPARSITY, max_model_len=256) as llm:
        (out,) = llm.generate([prompt], params)
    # The ring (6 tokens) went round five times; the sparse layers never held more than 20.
    assert out.kv_tokens_per_group == {"full": PROMPT_LEN, "budget20": KEPT}
    assert out.kv_tokens_held == {"full": PROMPT_LEN + NEW_TOKENS - 1, "budget20": 20}
    expected = teacher_forced_greedy(model, prompt + out.token_ids[:-1])
    assert out.token_ids == expected
    # And the oracle tells eviction apart: without it the tokens differ.
    with LLM(
        model=str(path),
        dtype="float32",
        sparsity=SparsityConfig(**{**vars(SPARSITY), "decode_eviction": False}),
        max_model_len=256,
    ) as llm:
        (grown,) = llm.generate([prompt], params)
    assert grown.token_ids != out.token_ids

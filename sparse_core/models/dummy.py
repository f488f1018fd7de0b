"""Random weights of a model's real shape (the `dummy` load format), as a full HF checkpoint.

Each tensor comes from its own seeded generator, so every tensor-parallel rank sees the same
full tensors and keeps its part: a TP run computes what a single-rank run computes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sparse_core.models.config import ModelConfig


def checkpoint_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hugging Face parameter names and full shapes of a Llama-architecture checkpoint."""
    hidden, inter, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * dim, config.num_key_value_heads * dim
    yield "model.embed_tokens.weight", (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        yield f"{prefix}.self_attn.q_proj.weight", (q, hidden)
        yield f"{prefix}.self_attn.k_proj.weight", (kv, hidden)
        yield f"{prefix}.self_attn.v_proj.weight", (kv, hidden)
        if config.attention_bias:
            yield f"{prefix}.self_attn.q_proj.bias", (q,)
            yield f"{prefix}.self_attn.k_proj.bias", (kv,)
            yield f"{prefix}.self_attn.v_proj.bias", (kv,)
        yield f"{prefix}.self_attn.o_proj.weight", (hidden, q)
        if config.qk_norm:
            yield f"{prefix}.self_attn.q_norm.weight", (dim,)
            yield f"{prefix}.self_attn.k_norm.weight", (dim,)
        yield f"{prefix}.mlp.gate_proj.weight", (inter, hidden)
        yield f"{prefix}.mlp.up_proj.weight", (inter, hidden)
        yield f"{prefix}.mlp.down_proj.weight", (hidden, inter)
        yield f"{prefix}.input_layernorm.weight", (hidden,)
        yield f"{prefix}.post_attention_layernorm.weight", (hidden,)
        if config.sandwich_norms:
            yield f"{prefix}.pre_feedforward_layernorm.weight", (hidden,)
            yield f"{prefix}.post_feedforward_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, hidden)


def dummy_weights(
    config: ModelConfig, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Norms at one (stored as the checkpoint stores them: Gemma's as offsets from one), the
    rest small (std 0.02) so activations stay finite through many layers. Made one tensor at a
    time on `device`: only one full tensor exists at once."""
    for index, (name, shape) in enumerate(checkpoint_shapes(config)):
        if "norm" in name:
            yield name, torch.full(shape, 1.0 - config.norm_weight_offset, device=device)
            continue
        generator = torch.Generator(device).manual_seed(seed * 1_000_003 + index)
        yield name, torch.empty(shape, device=device).normal_(0.0, 0.02, generator=generator)

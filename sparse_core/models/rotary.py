"""Rotary position embedding: the frequencies (with Llama 3's and linear scaling) and the
cos/sin tables."""

from __future__ import annotations

import math

import torch
from torch import nn

from sparse_core.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        # Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`, short
        # ones kept, and the band in between interpolated.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of every position; the attention layers apply them to q and k as they
    store the keys (`KernelOps.rotate_and_store_kv`)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))
        # Rounded to the model's dtype (the default dtype while it is built), in which Hugging
        # Face and vLLM apply them too, and kept in float32 for the kernels.
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", freqs.cos().to(dtype).float(), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype).float(), persistent=False)

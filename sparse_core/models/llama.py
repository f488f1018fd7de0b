"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over packed tokens.

Parameters use Hugging Face names except two fusions: q/k/v projections into `qkv_proj` and
gate/up into `gate_up_proj` (one matmul each instead of three and two); `load_weights` fuses.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sparse_core.config import SparsityConfig
from sparse_core.kernels import KernelOps
from sparse_core.models.attention import PagedAttention, StepMetadata
from sparse_core.models.config import ModelConfig
from sparse_core.policy import LayerPlan


class RMSNorm(nn.Module):
    """RMSNorm that also adds the residual stream first when given one (one fused kernel)."""

    def __init__(self, size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised x + residual, x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


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
    def __init__(self, config: ModelConfig, max_positions: int, ops: KernelOps) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(config))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.head_dim = config.head_dim
        self.ops = ops

    def apply_(self, positions: torch.Tensor, qk: torch.Tensor) -> None:
        """Rotate in place the q and k heads laid side by side in qk [T, (Hq + Hkv) * D]."""
        self.ops.apply_rotary_(qk, positions, self.cos, self.sin, self.head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn: PagedAttention, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.attn = attn
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        self.rotary.apply_(positions, qkv[:, : q_size + kv_size])
        q, k, v = qkv.split(self.split, dim=-1)
        out = self.attn(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            meta,
        )
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, attn: PagedAttention, rotary: RotaryEmbedding, ops: KernelOps
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn, rotary)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's MLP output, not yet added to the residual stream: the add
        happens inside the fused norm."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attns: list[PagedAttention],
        max_positions: int,
        ops: KernelOps,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, max_positions, ops)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, a, self.rotary, ops) for a in attns)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        plan: LayerPlan,
        sparsity: SparsityConfig,
        ops: KernelOps,
        max_positions: int,
    ) -> None:
        super().__init__()
        self.config = config
        attns = [
            PagedAttention(
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                group=plan.layer_to_group[i],
                budget=plan.groups[plan.layer_to_group[i]].budget,
                sparsity=sparsity,
                ops=ops,
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = LlamaModel(config, attns, max_positions, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        unset = set(params)
        if self.config.tie_word_embeddings:
            unset.discard("lm_head.weight")
        for name, tensor in weights.items():
            if "rotary_emb" in name:
                continue
            target, shard = name, None
            for part, (fused_name, index) in fused.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused_name), index
            if target not in params:
                if target == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    _copy_checked(param, tensor, name)
                else:
                    _copy_checked(self._shard_view(target, param, shard), tensor, name)
            unset.discard(target)
        if unset:
            raise ValueError(f"checkpoint is missing weights for {sorted(unset)[:5]} ...")

    def _shard_view(self, target: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        cfg = self.config
        if "qkv_proj" in target:
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [cfg.intermediate_size] * 2
        return param.split(sizes, dim=0)[shard]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch for {name!r}: model {tuple(dst.shape)}, checkpoint {tuple(src.shape)}"
        )
    dst.copy_(src)

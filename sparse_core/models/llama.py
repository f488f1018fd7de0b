"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, and Gemma 3's
variant: norms around attention and the MLP, GELU, scaled embeddings, sliding-window layers
with RoPE of their own) over packed tokens.

Parameters use Hugging Face names except two fusions: q/k/v projections into `qkv_proj` and
gate/up into `gate_up_proj` (one matmul each instead of three and two); `load_weights` fuses.
Under tensor parallelism every rank builds the same model with its share of the heads, MLP
columns and vocabulary (sparse_core.distributed.layers); `load_weights` takes full tensors and
keeps the rank's part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from sparse_core.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QuantizableLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_checked,
)
from sparse_core.distributed.parallel_state import get_tp_rank, get_tp_size
from sparse_core.kernels import KernelOps
from sparse_core.kernels.fp8 import FP8_DTYPE, FP8Rows
from sparse_core.models.attention import PagedAttention, StepMetadata
from sparse_core.models.config import ModelConfig
from sparse_core.models.rotary import RotaryEmbedding
from sparse_core.policy import LayerPlan


class RMSNorm(nn.Module):
    """RMSNorm that also adds the residual stream first when given one (one fused kernel).

    Gemma stores a norm's weight as an offset from one (`ModelConfig.norm_weight_offset`): its
    1 + weight is kept in float32, as Gemma computes it, since in bf16 an offset under 2^-8
    would round away."""

    def __init__(self, size: int, config: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        dtype = torch.float32 if config.norm_weight_offset else None
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = config.rms_norm_eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, quantize: bool = False
    ) -> tuple[torch.Tensor | FP8Rows, torch.Tensor]:
        """(normalised x + residual, x + residual); the first quantized for an FP8 linear layer
        with `quantize`."""
        norm = self.ops.rms_norm_fp8 if quantize else self.ops.rms_norm
        return norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn: PagedAttention) -> None:
        super().__init__()
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        full_q = config.num_attention_heads * config.head_dim
        full_kv = config.num_key_value_heads * config.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [full_q, full_kv, full_kv], bias=config.attention_bias
        )
        self.o_proj = RowParallelLinear(full_q, config.hidden_size, bias=False)
        self.attn = attn
        # Qwen3's and Gemma 3's per-head norms (one weight vector of head_dim, replicated on
        # every rank).
        self.q_norm = RMSNorm(config.head_dim, config, attn.ops) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config, attn.ops) if config.qk_norm else None

    def project(self, x: torch.Tensor | FP8Rows) -> torch.Tensor:
        """x [T, hidden] -> qkv [T, (Hq + 2 Hkv) * D], before RoPE (`attend` applies it)."""
        return self.qkv_proj(x)

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] -> attention output [T, Hq * D] (before o_proj); RoPE is
        applied to q and k in place as the keys and values are stored."""
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view_as(k)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), positions, meta)
        return out.flatten(1)


# A step's MLP runs over slices of at most this many tokens: its intermediate activations (3.5
# hidden sizes per token for Llama 3, the largest of a step) then stop growing with the step,
# which leaves more of the GPU to the KV cache; 2,048 rows keep the matmuls compute-bound.
MLP_SLICE_TOKENS = 2048


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)
        self.ops = ops
        self.activation = config.hidden_act

    def forward(self, x: torch.Tensor | FP8Rows) -> torch.Tensor:
        if len(x) <= MLP_SLICE_TOKENS:
            return self._mlp(x)
        hidden = self.down_proj.out_features
        out = torch.empty(len(x), hidden, dtype=x.dtype, device=x.device)
        for start in range(0, len(x), MLP_SLICE_TOKENS):
            rows = slice(start, start + MLP_SLICE_TOKENS)
            self._mlp(x[rows], out[rows])
        return out

    def _mlp(self, x: torch.Tensor | FP8Rows, out: torch.Tensor | None = None) -> torch.Tensor:
        # An FP8 down projection takes its input quantized by the activation's kernel.
        act = self.ops.act_and_mul_fp8 if self.down_proj.is_fp8 else self.ops.act_and_mul
        return self.down_proj(act(self.gate_up_proj(x), self.activation), out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn: PagedAttention, ops: KernelOps) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn)
        self.mlp = LlamaMLP(config, ops)
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config, ops)
        self.post_attention_layernorm = RMSNorm(hidden, config, ops)
        # Gemma's sandwich: post_attention_layernorm normalises the attention output before the
        # residual add, pre_feedforward_layernorm the MLP input, post_feedforward_layernorm its
        # output. Llama's post_attention_layernorm is Gemma's pre_feedforward_layernorm.
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, config, ops)
            self.post_feedforward_layernorm = RMSNorm(hidden, config, ops)

    # A layer runs in three parts, so that CUDA graphs can capture everything between two
    # attentions (LlamaForCausalLM.piece): attention_input, self_attn.attend, after_attention.
    # x is the previous layer's MLP output, not yet added to the residual stream: the add
    # happens inside the fused norm. A norm that feeds an FP8 projection quantizes its output
    # for it.

    def attention_input(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv, residual stream)."""
        h, residual = self.input_layernorm(x, residual, self.self_attn.qkv_proj.is_fp8)
        return self.self_attn.project(h), residual

    def after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream) from the attention output [T, Hq * D]."""
        x = self.self_attn.o_proj(attn_out)
        fp8_mlp = self.mlp.gate_up_proj.is_fp8
        if not self.sandwich:
            h, residual = self.post_attention_layernorm(x, residual, fp8_mlp)
            return self.mlp(h), residual
        x = self.post_attention_layernorm(x)[0]
        h, residual = self.pre_feedforward_layernorm(x, residual, fp8_mlp)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attns: list[PagedAttention],
        rotary: RotaryEmbedding,
        ops: KernelOps,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Rounded to the model's dtype (the default dtype while it is built), as Gemma's own.
        dtype = torch.get_default_dtype()
        self.embedding_scale = float(torch.tensor(config.embedding_scale, dtype=dtype))
        self.rotary = rotary  # shared with the attention layers, which apply it
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, a, ops) for a in attns)
        self.norm = RMSNorm(config.hidden_size, config, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        plan: LayerPlan,
        ops: KernelOps,
        max_positions: int,
    ) -> None:
        super().__init__()
        self.config = config
        tp_size = get_tp_size()
        local_kv = config.num_key_value_heads // tp_size
        # This rank's KV heads among the model's: (first, total).
        self.kv_heads = (get_tp_rank() * local_kv, config.num_key_value_heads)
        rotary = RotaryEmbedding(config, max_positions)
        # Sliding-window layers (Gemma 3) rotate with a base of their own, unscaled.
        local_rotary = rotary
        if config.rope_local_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.rope_local_theta, rope_scaling=None
            )
            local_rotary = RotaryEmbedding(local, max_positions)
        attns = [
            PagedAttention(
                config.num_attention_heads // tp_size,
                local_kv,
                config.head_dim,
                group=plan.layer_to_group[i],
                ops=ops,
                rotary=local_rotary if config.is_sliding(i) else rotary,
                scale=config.attention_scale,
                sliding_window=config.sliding_window if config.is_sliding(i) else None,
            )
            for i in range(config.num_hidden_layers)
        ]
        self.model = LlamaModel(config, attns, rotary, ops)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def num_pieces(self) -> int:
        """The stretches between attentions: one more than the layers."""
        return len(self.model.layers) + 1

    def piece(
        self,
        index: int,
        input_ids: torch.Tensor | None = None,
        attn_out: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What runs between attention index - 1 and attention index: the embedding of
        input_ids (piece 0) or layer index - 1 from its attention output on, then layer index up
        to its attention. Returns (qkv, residual stream), or (final hidden states, None) for the
        last piece."""
        layers = self.model.layers
        if index == 0:
            x, residual = self.model.embed_tokens(input_ids), None
            if self.model.embedding_scale != 1.0:  # Gemma's
                x = x * self.model.embedding_scale
        else:
            x, residual = layers[index - 1].after_attention(attn_out, residual)
        if index == len(layers):
            return self.model.norm(x, residual)[0], None
        return layers[index].attention_input(x, residual)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: StepMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of every token, or only of `rows` (indices): the last
        layer's attention has then stored its keys and values and scored the prompt, and what
        follows it (o_proj, the MLP, the final norm) runs on those rows alone. For a
        4,000-token prompt that leaves out about 1/36 of Llama-3-8B's matmuls, with the same
        result."""
        out, residual = self.piece(0, input_ids=input_ids)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            attn_out = layer.self_attn.attend(positions, out, meta)  # out: this layer's qkv
            if i == last and rows is not None:
                attn_out, residual = attn_out[rows], residual[rows]
            out, residual = self.piece(i + 1, attn_out=attn_out, residual=residual)
        return out  # the last piece's: the final hidden states

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [T, V]; written into `out` when given (a static buffer)."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Copy Hugging Face-named full tensors in, fusing q/k/v and gate/up and keeping this
        rank's part of sharded layers; every parameter must be set. A pre-quantized checkpoint's
        FP8 projections (an e4m3 `weight` and its `weight_scale`, one per output row) make their
        layer FP8 as they load, the tensors copied as they are (QuantizableLinear.expect_fp8)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
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
        started: set[str] = set()  # layers that got a weight (part)
        items = weights.items() if isinstance(weights, Mapping) else weights
        for name, tensor in items:
            if "rotary_emb" in name:
                continue
            target, index = name, 0
            for part, (fused_name, i) in fused.items():
                if f".{part}." in name:
                    target, index = name.replace(part, fused_name), i
            layer_name, _, kind = target.rpartition(".")
            if tensor.dtype == FP8_DTYPE or kind == "weight_scale":
                layer = modules.get(layer_name)
                if not isinstance(layer, QuantizableLinear):
                    raise ValueError(
                        f"checkpoint tensor {name!r}: only the attention and MLP projections "
                        "can be FP8 (a quantized checkpoint must list this layer in its "
                        "quantization config's `ignore`)"
                    )
                if layer.weight.dtype != FP8_DTYPE:
                    if layer_name in started:
                        raise _mixed_fp8(name, layer_name)
                    layer.expect_fp8()
                    params[f"{layer_name}.weight"] = layer.weight
                    params[f"{layer_name}.weight_scale"] = layer.weight_scale
                    unset.add(f"{layer_name}.weight_scale")
                if kind == "weight_scale":
                    tensor = tensor.reshape(-1, 1)  # (out, 1) or (out,) in the checkpoint
            elif (
                kind == "weight"
                and params.get(target, tensor).dtype == FP8_DTYPE
                and not modules[layer_name].quantizes_at_load
            ):
                raise _mixed_fp8(name, layer_name)
            if kind == "weight":
                started.add(layer_name)
            if target not in params:
                if target == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            if isinstance(modules[layer_name], RMSNorm) and self.config.norm_weight_offset:
                tensor = tensor.float() + self.config.norm_weight_offset  # Gemma's 1 + weight
            load_full = getattr(modules[layer_name], "load_full", None)
            with torch.no_grad():
                if load_full is None:  # norms: replicated on every rank
                    copy_checked(param, tensor, name)
                else:
                    load_full(param, tensor, index, name)
            unset.discard(target)
        if unset:
            raise ValueError(f"checkpoint is missing weights for {sorted(unset)[:5]} ...")


def _mixed_fp8(name: str, layer_name: str) -> ValueError:
    return ValueError(
        f"checkpoint tensor {name!r}: {layer_name} fuses projections that the checkpoint stores "
        "partly in FP8 and partly unquantized (its quantization config's `ignore` splits them); "
        "not supported"
    )

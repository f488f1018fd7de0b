"""Shape and hyper-parameters of a Llama-architecture model (Llama 2/3, Mistral, Qwen2, Qwen3,
SmolLM2) and of Gemma 3's variant of it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sparse_core.models.prequantized import CheckpointQuantization
from sparse_core.policy import SlidingLayers

# Hugging Face model types read from config.json.
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SLIDING = "sliding_attention"  # Hugging Face's layer type of a sliding-window layer


@dataclass
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on the q/k/v projections
    # Qwen3: an RMSNorm over each query and key head (weights of head_dim) before RoPE.
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"
    # The checkpoint's own quantization (config.json's quantization_config; models/prequantized.py):
    # its linear weights are stored in FP8 with their scales. None: unquantized weights.
    checkpoint_quantization: CheckpointQuantization | None = None
    # Gemma 3. Layers whose type is "sliding_attention" attend to the last `sliding_window`
    # tokens only (the token itself included), with RoPE of base `rope_local_theta`.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    hidden_act: str = "silu"  # the MLP's gate activation: silu | gelu_pytorch_tanh
    # Gemma's layer layout: norms after attention and after the MLP too (four a layer), norm
    # weights stored as offsets from 1 (the loader adds it), embeddings scaled by
    # sqrt(hidden_size).
    sandwich_norms: bool = False
    norm_weight_offset: float = 0.0
    scaled_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def embedding_scale(self) -> float:
        return self.hidden_size**0.5 if self.scaled_embeddings else 1.0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding(self) -> SlidingLayers | None:
        """The sliding-window layers, if the model has any."""
        if self.sliding_window is None or not self.layer_types:
            return None
        layers = tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)
        return SlidingLayers(self.sliding_window, layers) if layers else None

    @property
    def num_scored_layers(self) -> int:
        """The layers that attend to the whole context, which sparsity configs and calibrated
        profiles index (`policy.plan_layers`): all but the sliding-window ones."""
        sliding = self.sliding
        return self.num_hidden_layers - (len(sliding.layers) if sliding is not None else 0)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary."""
        if hf.get("model_type") == "gemma3_text":
            return _gemma3_from_hf_dict(hf, name)
        eos = hf.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers >= 5 may nest RoPE settings under "rope_parameters".
        rope_params = hf.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            vocab_size=hf["vocab_size"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", hf.get("model_type") == "qwen2"),
            qk_norm=hf.get("model_type") == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    def with_overrides(self, overrides: dict[str, Any] | None) -> ModelConfig:
        """A copy with some fields replaced (vLLM's `hf_overrides`); unknown keys are an error."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown model config override(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)


# What makes a Llama-architecture model Gemma 3's, beside its shape and layer types.
GEMMA3_LAYOUT: dict[str, Any] = {
    "qk_norm": True,
    "sandwich_norms": True,
    "norm_weight_offset": 1.0,
    "scaled_embeddings": True,
}


def gemma3_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every `pattern`-th layer global, the others sliding-window (Gemma 3: 6)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _gemma3_from_hf_dict(hf: dict[str, Any], name: str) -> ModelConfig:
    """Gemma 3's text config: RoPE per layer type (transformers >= 5 nests it under
    `rope_parameters` by layer type; earlier configs give `rope_theta`, `rope_scaling` and
    `rope_local_base_freq`), layer types listed or given by their pattern. What the file leaves
    out (the hub's multimodal checkpoints give a few fields of their text model) takes the
    defaults of transformers' Gemma3TextConfig."""
    from transformers import Gemma3TextConfig  # imported here: only Gemma 3 needs it

    hf = Gemma3TextConfig(**hf).to_dict()
    for softcap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(softcap) is not None:
            raise ValueError(f"{name}: {softcap} is set; logit soft-capping is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{name}: use_bidirectional_attention is set; only causal attention is")
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        layer_types = gemma3_layer_types(num_layers, pattern)
    by_type = hf.get("rope_parameters") or {}
    full_rope = dict(by_type.get("full_attention") or hf.get("rope_scaling") or {})
    theta = full_rope.pop("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local_theta = (by_type.get(SLIDING) or {}).get(
        "rope_theta", hf.get("rope_local_base_freq", 10_000.0)
    )
    scaling = full_rope if full_rope.get("rope_type", "default") != "default" else None
    eos = hf.get("eos_token_id")
    return ModelConfig(
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        vocab_size=hf["vocab_size"],
        head_dim=hf.get("head_dim", 256),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        attention_bias=hf.get("attention_bias", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        name=name,
        layer_types=tuple(layer_types),
        sliding_window=hf.get("sliding_window", 4096),
        rope_local_theta=float(local_theta),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
        hidden_act=hf.get("hidden_activation", "gelu_pytorch_tanh"),
        **GEMMA3_LAYOUT,
    )


# Random-weight presets of real shapes (`dummy:<name>`), for benchmarks and tests.
DUMMY_PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        name="dummy:llama3-8b",
    ),
    # Qwen3-8B's shape: head_dim 128 set apart from the hidden size, norms on q and k.
    "qwen3-8b": ModelConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        name="dummy:qwen3-8b",
    ),
    # Gemma-3-12B's text shape: 5 sliding-window layers (1,024 tokens) for each global one.
    "gemma3-12b": ModelConfig(
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        name="dummy:gemma3-12b",
        layer_types=gemma3_layer_types(48, 6),
        sliding_window=1024,
        rope_local_theta=10000.0,
        query_pre_attn_scalar=256,
        hidden_act="gelu_pytorch_tanh",
        **GEMMA3_LAYOUT,
    ),
    "smollm2-135m": ModelConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        name="dummy:smollm2-135m",
    ),
    # Gemma 3's architecture at the tiny size: two local layers (a window of 32) for each global
    # one, for tests.
    "gemma3-tiny": ModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        name="dummy:gemma3-tiny",
        layer_types=gemma3_layer_types(6, 3),
        sliding_window=32,
        rope_local_theta=10000.0,
        query_pre_attn_scalar=16,
        hidden_act="gelu_pytorch_tanh",
        **GEMMA3_LAYOUT,
    ),
    "tiny": ModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        rope_theta=10000.0,
        max_position_embeddings=16384,
        name="dummy:tiny",
    ),
}

"""Shape and hyper-parameters of a Llama-architecture model (Llama 2/3, Mistral, Qwen2, Qwen3,
SmolLM2)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sparse_core.models.prequantized import CheckpointQuantization


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

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary."""
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

"""Write a model that our loader reads (e.g. the built-in GGUF) as a Hugging Face directory.

vLLM loads Hugging Face directories; the built-in SmolLM2 ships only as a Q4_1 GGUF. Exporting
the weights our loader dequantised (float32, Q/K rows already in HF order) gives vLLM exactly
the numbers our native engine runs on, so the two engines can be compared token for token.
A `dummy:<preset>` model has no weights: its directory holds only `config.json`, which vLLM
fills with random weights (`load_format="dummy"`), as the benchmarks' random-weight models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from sparse_core.models.config import ModelConfig
from sparse_core.models.loader import load_model_source

CACHE_DIR = Path(os.environ.get("KVSPARSE_CACHE", Path.home() / ".cache" / "kvsparse"))


def export_hf_dir(model: str, out_dir: str | Path | None = None) -> Path:
    """The directory holding `model` in Hugging Face format, written on first use (for a dummy
    model, its config alone)."""
    name = model.replace(":", "-") if model.startswith("dummy:") else Path(model).stem
    out = Path(out_dir) if out_dir is not None else CACHE_DIR / "hf" / name
    if (out / "config.json").is_file():
        return out
    source = load_model_source(model)
    out.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16"
    if source.weights is not None:
        dtype = "float32"
        weights = {key: t.contiguous() for key, t in source.weights.items()}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        source.tokenizer._backend().save_pretrained(str(out))
    # config.json last, and renamed into place: a crash never leaves a directory that looks
    # complete (its presence is what marks the export done).
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(hf_config(source.config, dtype), indent=2))
    tmp.rename(out / "config.json")
    return out


def hf_config(c: ModelConfig, dtype: str) -> dict[str, Any]:
    """The Hugging Face `config.json` of `c`: Llama's, Qwen3's (norms on queries and keys) or
    Gemma 3's text model."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "hidden_act": c.hidden_act,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": (
            c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids or None
        ),
        "torch_dtype": dtype,
    }
    if c.sandwich_norms:
        assert c.layer_types is not None  # Gemma 3's config lists them
        config |= {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "hidden_activation": c.hidden_act,
            "layer_types": list(c.layer_types),
            "sliding_window": c.sliding_window,
            "rope_local_base_freq": c.rope_local_theta,
            "query_pre_attn_scalar": c.query_pre_attn_scalar,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }
    elif c.qk_norm:
        config |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    return config

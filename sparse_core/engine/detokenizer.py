"""Incremental detokenisation: text grows by the new token's characters each step, without
re-decoding the whole output (and without emitting half of a multi-byte character)."""

from __future__ import annotations

from sparse_core.models.tokenizer import Tokenizer

# A UTF-8 character has at most 4 bytes, so at most 4 byte-fallback tokens: a replacement
# character still trailing after more is invalid output (random weights), not an incomplete one.
# Emitting it then keeps each step's decode short instead of re-decoding an ever longer tail.
MAX_PENDING_TOKENS = 4


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
        pending = len(self.token_ids) - self.read_offset
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and pending <= MAX_PENDING_TOKENS):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix) :]

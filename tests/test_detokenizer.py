"""Incremental detokenisation: the text streamed token by token equals one decode of all tokens."""

import random

from sparse_core.engine.detokenizer import IncrementalDetokenizer
from sparse_core.models.tokenizer import ByteTokenizer


def stream(tokenizer: ByteTokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.append(i) for i in ids]


def test_a_multibyte_character_appears_once_complete():
    tokenizer = ByteTokenizer(512)
    pieces = stream(tokenizer, list("aé€".encode()))
    assert pieces == ["a", "", "é", "", "", "€"]


def test_tokens_without_text_do_not_break_a_character():
    tokenizer = ByteTokenizer(512)
    eos = tokenizer.eos_token_ids[0]  # decodes to nothing (special tokens are skipped)
    ids = [ord("a"), eos, eos, *"😀".encode(), ord("b")]
    assert "".join(stream(tokenizer, ids)) == "a😀b"


def test_random_weight_output_streams_the_same_text_as_a_full_decode():
    tokenizer = ByteTokenizer(128256)
    rng = random.Random(0)
    # Mostly ids past the byte range, some ASCII, some lone continuation bytes (invalid UTF-8).
    ids = [
        rng.choice([rng.randrange(300, 128000), rng.randrange(32, 127), 0xA9]) for _ in range(400)
    ] + [ord("!")]  # ends complete: nothing left pending
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def test_ids_past_the_byte_range_never_stay_pending():
    """So each step decodes only the last tokens, not the whole output again."""
    detokenizer = IncrementalDetokenizer(ByteTokenizer(128256))
    for _ in range(100):
        assert detokenizer.append(1000) != ""
        assert len(detokenizer.token_ids) - detokenizer.prefix_offset <= 2

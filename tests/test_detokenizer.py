"""Incremental detokenisation: the text streamed token by token equals one decode of all tokens."""

import random

from sparse_core.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from sparse_core.models.tokenizer import ByteTokenizer


def stream(tokenizer: ByteTokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.append(i) for i in ids]


def test_a_multibyte_character_appears_once_complete():
    tokenizer = ByteTokenizer(512)
    pieces = stream(tokenizer, list("aé€".encode()))
    assert pieces == ["a", "", "é", "", "", "€"]


def test_invalid_output_streams_the_same_text_as_a_full_decode():
    tokenizer = ByteTokenizer(128256)
    rng = random.Random(0)
    # What random weights produce: mostly ids past the byte range, some ASCII, some lone
    # continuation bytes.
    ids = [
        rng.choice([rng.randrange(300, 128000), rng.randrange(32, 127), 0xA9]) for _ in range(400)
    ] + [ord("!")]  # ends complete: nothing left pending
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_a_run_of_invalid_tokens_does_not_stay_pending():
    tokenizer = ByteTokenizer(128256)
    detokenizer = IncrementalDetokenizer(tokenizer)
    for _ in range(100):
        detokenizer.append(1000)
        # Each step decodes only the last few tokens, not the whole output.
        assert len(detokenizer.token_ids) - detokenizer.prefix_offset <= 2 * (
            MAX_PENDING_TOKENS + 1
        )

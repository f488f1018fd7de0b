"""OpenAI response bodies for completions and chat, whole or as stream chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.messages import Chunk, TextLogprobs


@dataclass
class Choice:
    """One choice as it accumulates while its chunks arrive."""

    index: int
    prompt_index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    compression_ratio: float = 1.0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    logprobs: list[TextLogprobs] = field(default_factory=list)


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Prompt tokens count once per prompt, whatever `n` is (as OpenAI counts them); so do the
    cached ones (the most any of the prompt's choices found in the prefix cache)."""
    prompt = sum({c.prompt_index: c.prompt_tokens for c in choices}.values())
    cached: dict[int, int] = {}
    for c in choices:
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def kvsparse_summary(pool: str, choices: list[Choice]) -> dict[str, Any]:
    """The response's `kvsparse` extension: the pool that answered and the prompt compression
    (prompt token-layers over kept token-layers, over all choices)."""
    kept = sum(c.prompt_tokens / c.compression_ratio for c in choices if c.compression_ratio)
    total = sum(c.prompt_tokens for c in choices)
    return {"pool": pool, "compression_ratio": round(total / kept, 4) if kept else 1.0}


class CompletionFormat:
    object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, return_token_ids: bool = False, logprobs: bool = False) -> None:
        """`logprobs`: the request asked for them (the choices' `logprobs` are null otherwise)."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self.logprobs = logprobs
        # Per choice of a stream: characters of the tokens whose logprobs went out.
        self._streamed_chars: dict[int, int] = {}

    def _token_ids(self, token_ids: list[int], prompt_token_ids: list[int] | None) -> dict:
        """vLLM's `return_token_ids` fields of a choice, when the request asked for them."""
        if not self.return_token_ids:
            return {}
        return {"prompt_token_ids": prompt_token_ids, "token_ids": token_ids}

    def _logprobs(
        self, entries: list[TextLogprobs], streamed: int | None = None
    ) -> dict[str, Any] | None:
        """OpenAI's legacy completions `logprobs`, as vLLM gives them: `top_logprobs` holds the
        most likely tokens and the chosen one, even when it is not among them; `text_offset`
        counts the characters of the tokens before each (in a stream, of choice `streamed`'s
        earlier chunks too)."""
        if not self.logprobs:
            return None
        offset = self._streamed_chars.get(streamed, 0) if streamed is not None else 0
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        if streamed is not None:
            self._streamed_chars[streamed] = offset
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**dict(e.top), e.token: e.logprob} for e in entries],
            "text_offset": offsets,
        }

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def opening(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return []

    def chunk(self, choice: Choice, chunk: Chunk) -> dict[str, Any]:
        return self._envelope(
            self.object,
            [
                {
                    "index": choice.index,
                    "text": chunk.text,
                    "logprobs": self._logprobs(chunk.logprobs, choice.index),
                    "finish_reason": chunk.finish_reason,
                    **self._token_ids(chunk.token_ids, chunk.prompt_token_ids),
                }
            ],
        )

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._envelope(self.object, []), "usage": usage(choices)}

    def response(self, choices: list[Choice], pool: str) -> dict[str, Any]:
        body = self._envelope(self.object, [self._choice(c) for c in choices])
        return {**body, "usage": usage(choices), "kvsparse": kvsparse_summary(pool, choices)}

    def _choice(self, c: Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "text": c.text,
            "logprobs": self._logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
            **self._token_ids(c.token_ids, c.prompt_token_ids),
        }


class ChatFormat(CompletionFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def opening(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """The role comes first, as in OpenAI's streams."""
        return [
            self._envelope(
                self.chunk_object,
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for c in choices
        ]

    def _logprobs(
        self, entries: list[TextLogprobs], streamed: int | None = None
    ) -> dict[str, Any] | None:
        """Chat's `logprobs`: the chosen token's and, in `top_logprobs`, the most likely ones'."""
        if not self.logprobs:
            return None
        return {
            "content": [
                {**_token(e.token, e.logprob), "top_logprobs": [_token(*t) for t in e.top]}
                for e in entries
            ]
        }

    def chunk(self, choice: Choice, chunk: Chunk) -> dict[str, Any]:
        delta = {"content": chunk.text} if chunk.text else {}
        return self._envelope(
            self.chunk_object,
            [
                {
                    "index": choice.index,
                    "delta": delta,
                    "logprobs": self._logprobs(chunk.logprobs, choice.index),
                    "finish_reason": chunk.finish_reason,
                    **self._token_ids(chunk.token_ids, chunk.prompt_token_ids),
                }
            ],
        )

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage(choices)}

    def _choice(self, c: Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": self._logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
            **self._token_ids(c.token_ids, c.prompt_token_ids),
        }


def _token(token: str, logprob: float) -> dict[str, Any]:
    """A token of chat's `logprobs`, with its UTF-8 bytes (of its text, as vLLM gives them)."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

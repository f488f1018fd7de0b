"""OpenAI response bodies for completions and chat, whole or as stream chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.messages import Chunk


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

    def __init__(self, model: str, return_token_ids: bool = False) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids

    def _token_ids(self, token_ids: list[int], prompt_token_ids: list[int] | None) -> dict:
        """vLLM's `return_token_ids` fields of a choice, when the request asked for them."""
        if not self.return_token_ids:
            return {}
        return {"prompt_token_ids": prompt_token_ids, "token_ids": token_ids}

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
                    "logprobs": None,
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
            "logprobs": None,
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

    def chunk(self, choice: Choice, chunk: Chunk) -> dict[str, Any]:
        delta = {"content": chunk.text} if chunk.text else {}
        return self._envelope(
            self.chunk_object,
            [
                {
                    "index": choice.index,
                    "delta": delta,
                    "logprobs": None,
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
            "logprobs": None,
            "finish_reason": c.finish_reason,
            **self._token_ids(c.token_ids, c.prompt_token_ids),
        }

"""What crosses between the HTTP layer and an engine worker (possibly another process): plain
dataclasses, and the engine's torch-free vocabulary (`SamplingParams`), so that the Ray ingress
does not load torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparse_core.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One prompt of an OpenAI request; `n` choices are `n` requests with their own ids."""

    request_id: str
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict[str, str]] | None = None  # chat: rendered with the model's template
    # The engine's settings (max_tokens None: whatever the context leaves; `logprobs`: chunks
    # carry each new token's logprob and its most likely alternatives').
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=None))
    # vLLM's `return_token_ids`: chunks carry the token ids (the prompt's in the first).
    return_token_ids: bool = False


@dataclass
class TextLogprobs:
    """A generated token's text and logprob, and `top`: the most likely tokens' (text,
    logprob) at its position, most likely first."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Chunk:
    """New text since the previous chunk. The first chunk of a stream (no text, no tokens) says
    the request passed validation; the last one carries the finish reason."""

    text: str
    num_tokens: int  # generated so far
    prompt_tokens: int
    finish_reason: str | None = None
    compression_ratio: float = 1.0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # With GenerateRequest.return_token_ids: the ids of the new tokens, and the prompt's ids in
    # the first chunk that carries tokens.
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    # With GenerateRequest.logprobs set: the new tokens' logprobs.
    logprobs: list[TextLogprobs] = field(default_factory=list)

    def then(self, later: Chunk) -> Chunk:
        """This chunk and the one after it, as one."""
        return Chunk(
            self.text + later.text,
            later.num_tokens,
            later.prompt_tokens,
            later.finish_reason,
            later.compression_ratio,
            later.cached_tokens,
            self.token_ids + later.token_ids,
            self.prompt_token_ids if self.prompt_token_ids is not None else later.prompt_token_ids,
            self.logprobs + later.logprobs,
        )


@dataclass
class RoutingStats:
    """What a replica tells the router (see service/router.py)."""

    kv_free_fraction: float  # of the KV cache's blocks
    kv_per_request_fraction: float  # KV one more request is expected to take
    num_running: int
    num_waiting: int
    max_num_seqs: int

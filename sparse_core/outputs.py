"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """A generated token's log-probability (`SamplingParams.logprobs`), and `top`: the
    (token id, logprob) of the most likely tokens at its position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """A request's state after a step (streaming) or at the end.

    `kv_tokens_per_group` maps each layer group to the tokens per layer its cache kept from the
    prompt; `kv_tokens_held`, of a finished request, to the tokens per layer its cache held at
    the end (the prompt's kept ones and every token fed after them: the generated ones but the
    last; with async scheduling, one more where the step launched ahead had taken its slot;
    empty for a request that ended while not running); `compression_ratio` is prompt
    token-layers over kept token-layers (1.0 when dense). `logprobs`, when the request asked
    for them: one entry per generated token, as `token_ids`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    kv_tokens_per_group: dict[str, int] = field(default_factory=dict)
    kv_tokens_held: dict[str, int] = field(default_factory=dict)
    compression_ratio: float = 1.0
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache (vLLM's name; the most any admission found).
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[TokenLogprobs] | None = None

"""Per-request generation settings, in vLLM's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

# A seed is a signed 64-bit integer, as in vLLM.
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass
class SamplingParams:
    """temperature 0 is greedy; `stop` strings are cut from the returned text, as OpenAI does.

    compress_prefix_len: prefill (and compress) only the first N prompt tokens, with the
    observation window at their end; the rest of the prompt is then fed one token per step over
    the compressed cache, so compression never sees it (the "query-agnostic" setting: context
    first, question after). None prefills the whole prompt at once. Either way the whole prompt
    is the request's prompt (`prompt_token_ids`), and its output starts after it.

    Penalties, as vLLM applies them to the logits before sampling (greedy included):
    `repetition_penalty` (> 1 discourages) divides positive logits and multiplies negative ones
    of every token in the prompt or the output so far; `presence_penalty` is subtracted once
    from each token that occurs in the output, `frequency_penalty` once per occurrence (both in
    [-2, 2], positive discourages). `min_tokens`: before that many tokens are generated, EOS and
    `stop_token_ids` cannot be sampled and stop strings do not end the request.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    compress_prefix_len: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The model's EOS ids, set by the engine when it accepts the request (min_tokens bans them).
    eos_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**63 - 1], got {self.seed}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        n = self.compress_prefix_len
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"compress_prefix_len must be a positive integer or None, got {n!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 count as 0, as in vLLM: their distribution is the argmax in
        all but float rounding."""
        return self.temperature < 1e-5

    @property
    def penalizes(self) -> bool:
        """Whether any penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def banned_until_min_tokens(self) -> list[int]:
        """Ids that cannot be sampled before `min_tokens` outputs: those that would stop it."""
        eos = [] if self.ignore_eos else self.eos_token_ids
        return list(dict.fromkeys([*self.stop_token_ids, *eos]))

"""Per-request generation settings, in vLLM's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """temperature 0 is greedy; `stop` strings are cut from the returned text, as OpenAI does.

    compress_prefix_len: prefill (and compress) only the first N prompt tokens, with the
    observation window at their end; the rest of the prompt is then fed one token per step over
    the compressed cache, so compression never sees it (the "query-agnostic" setting: context
    first, question after). None prefills the whole prompt at once. Either way the whole prompt
    is the request's prompt (`prompt_token_ids`), and its output starts after it.
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

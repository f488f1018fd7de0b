"""Per-request generation settings, in vLLM's vocabulary."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# A seed is a signed 64-bit integer, as in vLLM.
SEED_RANGE = (-(2**63), 2**63 - 1)
# Bounds on what one request may ask every step to check: stop strings are searched in each new
# piece of text on the engine's thread, so their number and length are what a request costs
# every other request of its steps (OpenAI takes at most 4).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
MAX_STOP_TOKEN_IDS = 1024
# The most top logprobs a request may ask for per token (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
# `logit_bias`: the most token ids a request may bias (applied to its logits every step), and
# the range of a bias (OpenAI's).
MAX_LOGIT_BIAS_TOKENS = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)


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

    `logit_bias` (OpenAI's and vLLM's): {token id: bias in [-100, 100]}, added to those tokens'
    logits before penalties and sampling (greedy included): -100 all but bans a token, 100 all
    but forces it. Logprobs are of the logits before it.

    `logprobs` (vLLM's): return each generated token's log-probability and those of the
    `logprobs` most likely tokens at its position (0: the generated token's only; at most
    MAX_LOGPROBS); None returns none. They are those of the model's raw output, before
    penalties, `min_tokens` bans, temperature, top-k and top-p, as vLLM's default
    (`logprobs_mode="raw_logprobs"`) returns them.
    """

    max_tokens: int | None = 16  # None: as many as max_model_len leaves (vLLM's)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (-1, vLLM's "off", is taken as 0)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    compress_prefix_len: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # The model's EOS ids, set by the engine when it accepts the request (min_tokens bans them).
    eos_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        """Checks what holds for any model; `verify` adds what depends on the model's
        vocabulary. Every message starts with the field's name."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):  # fmt: skip
            _check_finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 0, or -1 (both disable it), got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be in [-2**63, 2**63 - 1], got {self.seed}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self._check_stops()
        self._check_logit_bias()
        n = self.compress_prefix_len
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"compress_prefix_len must be a positive integer or None, got {n!r}")

    def _check_stops(self) -> None:
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got "
                             f"{len(self.stop)}")  # fmt: skip
        chars = sum(map(len, self.stop))
        if chars > MAX_STOP_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters "
                             f"together, got {chars}")  # fmt: skip
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}")  # fmt: skip
        _check_token_ids("stop_token_ids", self.stop_token_ids)

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} token ids, "
                             f"got {len(bias)}")  # fmt: skip
        _check_token_ids("logit_bias keys", bias)
        low, high = LOGIT_BIAS_RANGE
        for value in bias.values():
            _check_finite("logit_bias values", value)
            if not low <= value <= high:
                raise ValueError(f"logit_bias values must be in [{low:g}, {high:g}], got {value}")

    def verify(self, vocab_size: int) -> None:
        """What depends on the model: `top_k` at most the vocabulary, `stop_token_ids` and
        `logit_bias`'s token ids in it.
        Engines call it when they accept a request, so that nothing the device code cannot take
        reaches a batched step (where it would fail every request of the step)."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab_size} (or 0 or "
                             f"-1 to disable it), got {self.top_k}")  # fmt: skip
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias keys", self.logit_bias or {})):  # fmt: skip
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(f"{name} must be in [0, {vocab_size}), the model's "
                                 f"vocabulary; got {outside[0]}")  # fmt: skip

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


def _check_token_ids(name: str, ids: Iterable[int]) -> None:
    for token in ids:
        _check_int(name, token)
        if token < 0:
            raise ValueError(f"{name} must be token ids (>= 0), got {token}")


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_finite(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")

"""OpenAI request bodies (parsed strictly: a string is not a number) and the `kvsparse` extension.

Unknown fields are ignored, as vLLM does; fields that would change the answer in a way we cannot
honour (prompt logprobs, tools, guided decoding...) are refused with 400 rather than silently
dropped: `REFUSED` lists them with the values that change nothing, which are accepted.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service.errors import APIError
from sparse_core.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams

# Field -> its neutral values (accepted: they ask for nothing we do not do). Any other value is
# a 400 naming the field. Names are OpenAI's and vLLM's.
REFUSED: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,),
    "min_p": (None, 0, 0.0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
}
# Only in completions, and only in chat.
REFUSED_COMPLETIONS: dict[str, tuple[Any, ...]] = {"echo": (None, False), "suffix": (None, "")}
REFUSED_CHAT: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """`value` is one of `neutral`, a bool matching only a bool (0 is not False here)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class KVSparseOptions(BaseModel):
    """Per-request choice among the sparsity pools the server runs (see docs/serving.md)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    policy: str | None = None
    budget: int | None = Field(default=None, ge=1)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields of both endpoints. Unknown fields are kept (`model_extra`) to be checked against
    `REFUSED`, then ignored."""

    model_config = ConfigDict(strict=True, extra="allow")
    refused: ClassVar[dict[str, tuple[Any, ...]]] = REFUSED

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # vLLM's extensions, which load generators (ours included) rely on.
    top_k: int = Field(default=0, ge=-1)  # -1 or 0: off, as in vLLM
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    # OpenAI's: {token id (a JSON object's keys are strings): bias in [-100, 100]}.
    logit_bias: dict[str, float] | None = None
    # Each choice carries `token_ids` (the generated ids; in a stream, each chunk's new ones)
    # and `prompt_token_ids` (in a stream, in the choice's first chunk with tokens).
    return_token_ids: bool = False
    kvsparse: KVSparseOptions | None = None

    def unsupported(self) -> list[str]:
        extra = self.model_extra or {}
        return [
            name
            for name, neutral in self.refused.items()
            if name in extra and not _is_neutral(extra[name], neutral)
        ]

    def check(self) -> None:
        """What a field-by-field parse cannot see: refused fields; raises APIError."""
        unsupported = self.unsupported()
        if unsupported:
            raise APIError(
                400,
                f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not "
                "supported",
                param=unsupported[0],
                code="unsupported_parameter",
            )

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's `SamplingParams.logprobs`: how many top logprobs each generated token comes
        with (0: its own only); None: no logprobs."""
        return None

    def sampling_params(self, max_tokens: int | None, choice: int) -> SamplingParams:
        """The engine's settings for the request's choice `choice` (its seed: `choice_seed`);
        `max_tokens` None: whatever the context leaves. The one place the OpenAI fields map onto
        the engine's; a ValueError names a field the engine refuses."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.choice_seed(choice),
            stop=self.stop_list,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.num_logprobs,
            logit_bias=self.logit_bias_by_id,
        )

    @property
    def logit_bias_by_id(self) -> dict[int, float] | None:
        """`logit_bias` with its keys read as token ids (SamplingParams checks the rest)."""
        if self.logit_bias is None:
            return None
        by_id = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)  # as vLLM reads them; negative ones SamplingParams refuses
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}") from None
            by_id[token] = bias
        return by_id

    def choice_seed(self, index: int) -> int | None:
        """Choice `index`'s seed: `seed + index`, wrapped into the seed's range, so that the
        `n` choices of a seeded request differ."""
        if self.seed is None:
            return None
        low, high = SEED_RANGE
        return (self.seed + index - low) % (high - low + 1) + low

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    refused: ClassVar[dict[str, tuple[Any, ...]]] = {**REFUSED, **REFUSED_COMPLETIONS}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any) -> Any:
        """`"max_tokens": null` means the default, 16, as OpenAI answers it."""
        return 16 if value is None else value

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.best_of not in (None, self.n):
            names.append("best_of")
        return names

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):  # validated as one of the union's lists: all ints
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Strict):
    """A part of a message's content; only text parts are served (the models take text only)."""

    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    refused: ClassVar[dict[str, tuple[Any, ...]]] = {**REFUSED, **REFUSED_CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:  # as OpenAI refuses it
            raise APIError(400, "top_logprobs is only allowed when logprobs is true",
                           param="top_logprobs", code="invalid_value")  # fmt: skip
        for m, message in enumerate(self.messages):
            for p, part in enumerate(message.content if isinstance(message.content, list) else []):
                where = f"messages.{m}.content.{p}"
                if part.type != "text":
                    raise APIError(400, f"{where}: content parts of type {part.type!r} are not "
                                   "supported; this model takes text only", param="messages",
                                   code="unsupported_parameter")  # fmt: skip
                if part.text is None:
                    raise APIError(400, f"{where}.text: Field required", param="messages",
                                   code="missing_required_parameter")  # fmt: skip

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        """None: as many as the context leaves room for (OpenAI's default for chat)."""
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse(model: type[SamplingFields], body: bytes) -> Any:
    """Validate a JSON body; malformed JSON and wrong fields become a 400 naming the field."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
    request.check()
    return request


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _as_api_error(exc: ValidationError) -> APIError:
    error = exc.errors(include_url=False)[0]
    if error["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {error['msg']}", code="invalid_json")
    if error["type"] == "model_type" and not error["loc"]:
        return APIError(400, "request body must be a JSON object", code="invalid_json")
    # Union members appear in the location as type tags ("str", "list[int]", "TextPart"): drop them.
    loc = [
        str(part)
        for part in error["loc"]
        if isinstance(part, int) or (str(part).isidentifier() and str(part).islower()
                                     and part not in _TYPE_TAGS)
    ]  # fmt: skip
    param = loc[0] if loc else None
    code = "missing_required_parameter" if error["type"] == "missing" else "invalid_type"
    if error["type"].endswith(
        ("greater_than_equal", "greater_than", "less_than_equal", "less_than", "too_short")
    ):
        code = "invalid_value"
    return APIError(400, f"{'.'.join(loc)}: {error['msg']}", param=param, code=code)

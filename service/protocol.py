"""OpenAI request bodies (parsed strictly: a string is not a number) and the `kvsparse` extension.

Unknown fields are ignored, as vLLM does; fields that would change the answer in a way we cannot
honour (logprobs, tools, penalties...) are refused with 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.errors import APIError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class KVSparseOptions(BaseModel):
    """Per-request choice among the sparsity pools the server runs (see docs/serving.md)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    policy: str | None = None
    budget: int | None = Field(default=None, ge=1)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extensions, which load generators (ours included) rely on.
    top_k: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    kvsparse: KVSparseOptions | None = None
    # Accepted only at their neutral values.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def unsupported(self) -> list[str]:
        names = []
        if self.presence_penalty:
            names.append("presence_penalty")
        if self.frequency_penalty:
            names.append("frequency_penalty")
        if self.logit_bias:
            names.append("logit_bias")
        if self.logprobs not in (None, False):
            names.append("logprobs")
        return names

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.echo:
            names.append("echo")
        if self.suffix:
            names.append("suffix")
        if self.best_of not in (None, self.n):
            names.append("best_of")
        return names

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):  # validated as one of the union's lists: all ints
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.tools:
            names.append("tools")
        if self.tool_choice not in (None, "none"):
            names.append("tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            names.append("response_format")
        return names

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
    unsupported = request.unsupported()
    if unsupported:
        raise APIError(
            400,
            f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported",
            param=unsupported[0],
            code="unsupported_parameter",
        )
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
        ("greater_than_equal", "greater_than", "less_than_equal", "too_short")
    ):
        code = "invalid_value"
    return APIError(400, f"{'.'.join(loc)}: {error['msg']}", param=param, code=code)

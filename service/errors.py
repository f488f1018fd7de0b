"""Errors answered in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from sparse_core.sampling_params import SamplingParams

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request failure with its HTTP status; raised anywhere, answered by the app.

    It crosses Ray's process boundary as a plain value (the engine deployment yields it), so it
    pickles by its fields.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        return (APIError, (self.status, self.message, self.param, self.code, self.retry_after))

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def overloaded(message: str, status: int = 429, retry_after: int = 1) -> APIError:
    return APIError(status, message, code="server_overloaded", retry_after=retry_after)


def invalid_value(exc: ValueError, param: str | None) -> APIError:
    """A 400 for a ValueError of the engine's: one about a sampling field (SamplingParams'
    messages start with the field's name) names it, with code invalid_value; any other names
    `param`."""
    field = str(exc).split(" ", 1)[0]
    if field in SamplingParams.__dataclass_fields__:
        return APIError(400, str(exc), param=field, code="invalid_value")
    return APIError(400, str(exc), param=param)

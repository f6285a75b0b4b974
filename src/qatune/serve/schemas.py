"""Request bodies of the API (the OpenAI schema, plus qatune's extractive endpoint) and its errors.

Types are strict: ``"temperature": "0.5"`` is an error, not 0.5. Options the OpenAI schema has and qatune
does not implement are accepted only at their neutral value (``n: 1``, ``logprobs: null``, ...); any
other value is an error naming the option, never silently ignored. Other unknown fields are ignored,
as OpenAI clients send many.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from qatune.data.tables import clean_cell

# A string where the OpenAI schema allows "a string or an array of strings" becomes a one-item list
# before validation, so errors name the field (a union would name its members: 'stop.str').

# option -> the values that mean "not used"
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
    "top_logprobs": (None, 0), "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
}


class ApiError(Exception):
    """An error the client caused, answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ApiError(400, f"'{name}' is not supported by qatune serve (got {value!r}); leave it out",
                               param=name, code="unsupported_parameter")


class _Sampling(_Request):
    model: StrictStr | None = None
    """The id from GET /v1/models; may be left out (the server serves one run)."""
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: Annotated[list[StrictStr], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    """What torch's generator takes; checked with the request, so one client's seed can never fail a batch."""
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    context: StrictStr | None = None
    """qatune: the passage for an extractive run, or for a prompt template with {context}."""
    fields: dict[StrictStr, StrictStr] | None = None
    """qatune: the other columns the run's prompt names (``{"Total Marks": 3}``); numbers become text as
    in a spreadsheet (3.0 -> "3")."""
    grounded: Literal["auto", "on", "off"] | None = None
    """qatune: answer with a span of the passage (on), freely (off), or as the run decided (auto); default: the
    run's generate.grounded."""

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return _listed(value, "a string or an array of up to 4 strings")

    @field_validator("fields", mode="before")
    @classmethod
    def _field_values(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError('should be an object of column names and values, e.g. {"Total Marks": "3"}')
        texts = {}
        for name, cell in value.items():
            number = isinstance(cell, int | float) and not isinstance(cell, bool)
            if not (isinstance(cell, str) or (number and math.isfinite(cell))):
                raise ValueError(f"the value of {name!r} should be a string or a number")
            texts[name] = cell if isinstance(cell, str) else clean_cell(cell)
        return texts

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: StrictBool = False


class CompletionRequest(_Sampling):
    """POST /v1/completions: ``prompt`` is the question (one per request)."""

    prompt: Annotated[list[StrictStr], Field(min_length=1, max_length=1)]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return _listed(value, "a string (the question)")

    @property
    def question(self) -> str:
        return self.prompt[0]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        return _listed(value, "a string or an array of text parts")

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


class ChatRequest(_Sampling):
    """POST /v1/chat/completions: the last user message is the question; the system message (or
    ``context``) is the context of an extractive run or of a template with {context}."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("messages")
    @classmethod
    def _has_user_message(cls, messages: list[Message]) -> list[Message]:
        if not any(m.role == "user" for m in messages):
            raise ValueError("no message with role 'user': the last user message is the question")
        return messages

    @property
    def question(self) -> str:
        return next(m.text for m in reversed(self.messages) if m.role == "user")

    @property
    def system(self) -> str | None:
        texts = [m.text for m in self.messages if m.role in ("system", "developer")]
        return "\n".join(texts) if texts else None


class AnswerRequest(_Sampling):
    """POST /v1/answer (qatune's own): ``question`` (with ``context`` and ``fields`` as the run's prompt needs them)
    in, the answer out as one JSON object; a grading run's answer also parsed into its answer columns."""

    question: StrictStr


class ExtractRequest(_Request):
    """POST /v1/extract (extractive runs): the span of ``context`` that answers ``question``."""

    model: StrictStr | None = None
    question: StrictStr
    context: StrictStr
    max_answer_length: int | None = Field(None, ge=1, le=512)
    """Longest answer in tokens (default: the run's generate.max_answer_length)."""


def _listed(value: Any, expected: str) -> Any:
    if isinstance(value, str):
        return [value]
    if value is not None and not isinstance(value, list):
        raise ValueError(f"should be {expected}")
    return value


_Sampling.model_rebuild()

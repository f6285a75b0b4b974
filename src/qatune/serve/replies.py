"""Answers in the OpenAI shape: a chat or text completion, whole or as server-sent events.

A streamed answer holds its request's concurrency slot until the last byte is sent or the client left.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from qatune.data.grading_fields import AnswerTemplate
from qatune.serve.batching import Delta, Extracted, Failed, Finished
from qatune.serve.request_checks import Slot
from qatune.serve.schemas import ApiError, error_body


class Reply:
    """One request's answer in the OpenAI shape: a chat or text completion, whole or as server-sent events."""

    def __init__(self, model_id: str, chat: bool, prompt_tokens: int, tokenizer: Any):
        self.model_id, self.chat, self.prompt_tokens, self.tokenizer = model_id, chat, prompt_tokens, tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    async def collect(self, events: AsyncIterator[Any]) -> dict[str, Any]:
        text, reason, usage = await self._outcome(events)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": reason} if self.chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_id,
                "choices": [choice], "usage": usage}

    async def answer(self, events: AsyncIterator[Any], template: AnswerTemplate | None = None) -> dict[str, Any]:
        """qatune's own shape (POST /v1/answer): ``model``, ``answer``, ``finish_reason`` and ``usage``; with a
        grading run's answer template also ``parsed`` (whether the answer has every field of it) and ``fields``
        (each answer column found, its value as text; null when not even the first is found)."""
        text, reason, usage = await self._outcome(events)
        body: dict[str, Any] = {"model": self.model_id, "answer": text, "finish_reason": reason, "usage": usage}
        if template is not None:
            fields = template.parse(text)
            body.update(parsed=template.complete(fields), fields=fields)
        return body

    async def _outcome(self, events: AsyncIterator[Any]) -> tuple[str, str, dict[str, int]]:
        async for event in events:
            if isinstance(event, Failed):
                raise ApiError(500, event.message, code="model_failed", kind="server_error")
            if isinstance(event, (Finished, Extracted)):
                return self._final(event)
        raise ApiError(500, "the model gave no answer", kind="server_error")

    async def stream(self, events: AsyncIterator[Any], include_usage: bool) -> AsyncIterator[str]:
        if self.chat:
            yield self._chunk({"role": "assistant", "content": ""})
        async for event in events:
            if isinstance(event, Failed):
                yield _sse(error_body(event.message, "server_error", code="model_failed"))
                break
            if isinstance(event, Delta):
                yield self._chunk({"content": event.text} if self.chat else event.text)
                continue
            text, reason, usage = self._final(event)
            if isinstance(event, Extracted) and text:
                yield self._chunk({"content": text} if self.chat else text)
            yield self._chunk({} if self.chat else "", reason)
            if include_usage:
                yield _sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                            "model": self.model_id, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    def _final(self, event: Finished | Extracted) -> tuple[str, str, dict[str, int]]:
        if isinstance(event, Finished):
            text, reason, completion = event.text, event.finish_reason, event.completion_tokens
        else:
            text, reason = event.answer, "stop"
            completion = len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.prompt_tokens + completion}
        return text, reason, usage

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, content: dict[str, str] | str, finish_reason: str | None = None) -> str:
        choice = ({"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason} if self.chat else
                  {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason})
        return _sse({"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model_id,
                     "choices": [choice]})


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class SlotStreamingResponse(StreamingResponse):
    """A streamed answer that holds its concurrency slot until the last byte is sent (or the client left)."""

    def __init__(self, content: AsyncIterator[str], slot: Slot, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.slot = slot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()

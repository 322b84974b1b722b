"""The JSON of serve.py's answers in OpenAI's wire format: a whole response or the chunks of a
stream (Reply), the usage object, and server-sent events. The request bodies and the errors are
server_api's; a choice's `logprobs` object, which Reply places, is server_formats'.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

EVENT_STREAM = {"Cache-Control": "no-cache"}  # every text/event-stream response


@dataclass
class Reply:
    """The JSON a request gets back: one response, or the chunks of a stream.

    kind "chat" writes chat.completion objects (a `message`, or a `delta` per chunk with the
    role first); kind "text" writes text_completion objects (`text`).
    """

    kind: Literal["chat", "text"]
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"

    def response(
        self, choices: list[tuple[str | None, str, dict | None, list[dict]]], usage: dict[str, Any]
    ) -> dict[str, Any]:
        """The whole answer of a request that did not stream: (text, finish_reason, logprobs,
        tool calls) of each choice (a chat message's content is None when it only calls)."""
        out = []
        for index, (text, finish_reason, logprobs, calls) in enumerate(choices):
            if self.kind == "chat":
                message = {"role": "assistant", "content": text}
                choice = {"message": message | ({"tool_calls": calls} if calls else {})}
            else:
                choice = {"text": text}
            out.append(
                {**choice, "index": index, "finish_reason": finish_reason, "logprobs": logprobs}
            )
        return self._envelope("", out, usage=usage)

    def chunk(
        self,
        text: str = "",
        finish_reason: str | None = None,
        first: bool = False,
        index: int = 0,
        logprobs: dict | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk of choice `index`: new text (and the logprobs of its tokens) and
        the tool calls that closed, or the finish reason (a chat chunk carries the role once, in
        the choice's first chunk, and an empty delta with the finish reason)."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else {}
            if text or logprobs is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"delta": delta}
        else:
            choice = {"text": text}
        choice.update(index=index, finish_reason=finish_reason, logprobs=logprobs)
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope(".chunk", [choice], **extra)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: no choices, the token counts."""
        return self._envelope(".chunk", [], usage=usage)

    def _envelope(self, suffix: str, choices: list, **extra: Any) -> dict[str, Any]:
        kind = "chat.completion" + suffix if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object. cached_tokens: the prompt tokens whose KV came from the prefix
    cache (Week 4 Day 4) instead of a prefill, under OpenAI's name for them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line ("[DONE]" goes as is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"

"""The messages of a chat request (serve.py's /v1/chat/completions): what each role may send,
text parts, and the tool-calling turns an agent sends back (Week 4 Day 8): an assistant
message's `tool_calls` (its content then null or left out) and a `tool` message's result, tied to
its call by `tool_call_id`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from .server_formats import StrictBody
from .server_tools import MessageToolCall


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any
    name: str | None = None  # who spoke (LangChain sends it); the chat template may use it
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call whose result it holds

    @model_validator(mode="before")
    @classmethod
    def _calls_without_content(cls, data: Any) -> Any:
        """An assistant turn that only called tools may leave out its content."""
        if isinstance(data, dict) and data.get("tool_calls") and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> str | None:
        """A string, or a list of {"type": "text", "text": ...} parts (joined); None is left
        for the check below."""
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(_text_part(part, i) for i, part in enumerate(content))
        raise ValueError("must be a string or a list of text parts")

    @model_validator(mode="after")
    def _null_only_from_the_assistant(self) -> ChatMessage:
        """content null: what clients send back for an assistant turn that had no text (or
        only tool calls). tool_calls only from the assistant; tool_call_id in tool messages."""
        if self.content is None:
            if self.role != "assistant":
                raise ValueError("'content' may be null only in an assistant message")
            self.content = ""
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("'tool_calls' may only be sent in an assistant message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            need = "a tool message needs 'tool_call_id' (the call it answers)"
            raise ValueError(f"{need}, and only a tool message has one")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template takes it (a "developer" message is the newer
        name of a "system" one)."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.content}
        for field in ("name", "tool_call_id"):
            if getattr(self, field) is not None:
                message[field] = getattr(self, field)
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


def _text_part(part: Any, index: int) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
        raise ValueError(f"part {index}: only {{'type': 'text', 'text': ...}} parts are supported")
    if not isinstance(part["text"], str):
        raise ValueError(f"part {index}: 'text' must be a string")
    return part["text"]

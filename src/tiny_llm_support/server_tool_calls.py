"""The tool calls in a chat answer (Week 4 Day 8): the model's `<tool_call>` blocks, in
Qwen3's format, turned into OpenAI's `tool_calls`, whole or as a stream goes.

    Let me compute that.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "6 * 7"}}
    </tool_call>

becomes content "Let me compute that." and one call {id: "call_<hex>", type: "function",
function: {name: "calculator", arguments: '{"expression": "6 * 7"}'}} (the arguments as a JSON
string, as OpenAI sends them). A block whose text is not such a JSON object, or that names a
function the request did not offer, stays in the content as the model wrote it. The whitespace
that separates a block from the text around it is dropped, and the content of an answer that
is only calls is null.

A stream cannot wait for the end: ToolCallParser takes the text as it comes and says what may
be sent now. Text that may be the start of "<tool_call>" (and the whitespace before it) is held
back until the next text decides; a block is sent, whole, once it closes. An answer parsed in
one piece runs the same parser, so a stream's pieces join to the whole answer's.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .chat_format import CLOSE, OPEN


class ToolCallParser:
    """One choice's text in, (content that may be sent now, the calls that closed) out."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.pending = ""  # text that is not decided yet
        self.inside = False  # within a block: pending is its text so far
        self.after_call = False  # the whitespace that follows a block is dropped
        self.calls = 0  # calls found so far: the next one's index

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content that may be sent after `text`, and the calls it completed."""
        self.pending += text
        content, calls = [], []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                body, self.pending = self.pending[:end], self.pending[end + len(CLOSE) :]
                self.inside = False
                call = self._call(body)
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                    self.after_call = True
                continue
            if self.after_call:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.after_call = False
            start = self.pending.find(OPEN)
            if start >= 0:
                content.append(self.pending[:start].rstrip())
                self.pending, self.inside = self.pending[start + len(OPEN) :], True
                continue
            cut = _undecided(self.pending)
            content.append(self.pending[:cut])
            self.pending = self.pending[cut:]
            break
        return "".join(content), calls

    def finish(self) -> str:
        """The content held back at the end: an unclosed block as it was written, or the text
        that could have begun one (whitespace after a block is dropped)."""
        rest = OPEN + self.pending if self.inside else self.pending
        self.pending, self.inside = "", False
        return rest.lstrip() if self.after_call else rest

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer: (its content, None if it is only calls; its calls)."""
        content, calls = self.feed(text)
        content += self.finish()
        return (None if calls and not content else content), calls

    def _call(self, body: str) -> dict[str, Any] | None:
        """The OpenAI tool call of a block's text; None if it is not one."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return None
        name, arguments = call["name"], call["arguments"]
        if name not in self.names or not isinstance(arguments, dict):
            return None
        index, self.calls = self.calls, self.calls + 1
        return {
            "index": index,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }


def _undecided(text: str) -> int:
    """Where the text that cannot be sent yet starts: an end that could begin "<tool_call>",
    and the whitespace before it (dropped if a block follows)."""
    cut = len(text)
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            cut -= n
            break
    while cut and text[cut - 1].isspace():
        cut -= 1
    return cut


def without_index(call: dict[str, Any]) -> dict[str, Any]:
    """A call as a whole message's `tool_calls` holds it (a stream's delta has its index)."""
    return {key: value for key, value in call.items() if key != "index"}


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's "tool_calls" for an answer that ended by itself with calls in it."""
    return "tool_calls" if calls and reason == "stop" else reason

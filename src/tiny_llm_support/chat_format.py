"""A chat conversation with tools, as the model reads it (serve.py, Week 4 Day 8).

The model's own chat template renders the tools and the tool-calling turns when it knows them:
Qwen3's takes `tools=` (OpenAI's [{"type": "function", "function": {...}}]) and lists them in its
system message, writes an assistant message's `tool_calls` as <tool_call> blocks, and a `tool`
message's content as a user turn in <tool_response> tags. Those messages go to it as OpenAI
sends them.

A template that never mentions `tools` (the shipped tiny model's, which was trained without any)
would drop them, or fail on an assistant message with null content. Such a conversation is
rewritten here into plain system, user and assistant messages in Qwen3's format, and then goes
through the model's template like any other: render_with_tools' fallback.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # around each call the model makes


def template_knows_tools(tokenizer: Any) -> bool:
    """Whether the chat template reads the `tools` variable (Qwen3's does)."""
    return "tools" in (tokenizer.chat_template or "")


def render_with_tools(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    """The conversation through the chat template, with the tools it may call (None: none).
    A template that knows tools gets them and the messages as they are; another gets the
    conversation rewritten in Qwen3's format (qwen3_messages), which needs nothing of it."""
    if template_knows_tools(tokenizer):
        return tokenizer.apply_chat_template(messages, tools=tools or None)
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = qwen3_messages(messages, tools)
    return tokenizer.apply_chat_template(messages)


def qwen3_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The fallback: plain messages that a template without tools renders as Qwen3's template
    renders the conversation with them. The tools go into the system message (after the
    client's own system text, if the conversation starts with one); an assistant turn's calls
    follow its text as <tool_call> blocks; each run of `tool` messages becomes one user turn of
    <tool_response> blocks."""
    out: list[dict[str, Any]] = []
    rest = messages
    if tools:
        system = ""
        if messages and messages[0]["role"] == "system":
            system, rest = messages[0]["content"] + "\n\n", messages[1:]
        listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        out.append({"role": "system", "content": system + TOOLS_HEADER + listed + TOOLS_FOOTER})
    for message in rest:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif message["role"] == "assistant" and message.get("tool_calls"):
            text = message.get("content") or ""
            blocks = [_call_block(call) for call in message["tool_calls"]]
            out.append(
                {"role": "assistant", "content": "\n".join([text, *blocks] if text else blocks)}
            )
        else:
            out.append(
                {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
            )
    return [{k: v for k, v in m.items() if k != "tool_responses"} for m in out]


def _call_block(call: dict[str, Any]) -> str:
    """A call of an earlier turn as Qwen3's template writes it (its arguments as sent)."""
    function = call["function"]
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return call_block(function["name"], arguments)


def call_block(name: str, arguments: str) -> str:
    """One call as Qwen3 writes it: the function's name, then its arguments' JSON text."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{CLOSE}'

"""Tool calls on serve.py's /v1/chat/completions (Week 4 Day 8): a request's `tools` and
`tool_choice`, the tool calls of earlier turns that a conversation sends back, and the grammar
that makes the model call a tool.

A tool is a function the client runs: a name, a description and a JSON schema of its arguments
(`parameters`). The model reads them in its prompt (chat_format.py) and calls one by writing, in
Qwen3's format,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which server_tool_calls.py turns into OpenAI's `tool_calls`. tool_choice says whether it must:
"none" (no call is parsed: the answer is text), "auto" (whatever the model writes is parsed, the
default with tools), "required" (one call to any of the tools) or {"type": "function",
"function": {"name": ...}} (one call to that one). The last two are enforced rather than asked
for: a Lark grammar (llguidance) allows exactly one call block, the function's name written
out and its arguments as JSON that fits its parameters, then EOS. So even the tiny random model
answers with a call whose arguments validate. The JSON is written with Qwen3's template's
separators (", " and ": "), and each function's schema is the root of its own %json, so that its
$refs resolve as the client meant them. `parallel_tool_calls` is accepted; an enforced answer
is one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from .chat_format import call_block
from .server_formats import Grammars, SchemaError, StrictBody

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
# the arguments as Qwen3's chat template writes them (json.dumps' separators), no other spaces
ARGUMENT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A request's tools that cannot be served: the field at fault (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class FunctionDef(StrictBody):
    """A tool's function: what the model reads, and the schema of its arguments."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None  # the schema is always followed when a call is enforced

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters: Any) -> Any:
        if parameters is None:
            return None
        if not isinstance(parameters, dict):
            raise ValueError("a JSON schema must be a JSON object")
        if parameters.get("type", "object") != "object":
            raise ValueError("the arguments are a JSON object: the schema's type must be 'object'")
        return parameters

    def arguments_schema(self) -> dict[str, Any]:
        """The schema the arguments must fit: the parameters (typed "object" if they say no
        type), or with none, no arguments at all ({})."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return {"type": "object", **self.parameters}


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(StrictBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(StrictBody):
    """A call of an earlier assistant turn, sent back in `messages[i].tool_calls`."""

    id: str
    type: Literal["function"]
    function: CalledFunction


def tool_choice(value: Any) -> str | dict[str, Any] | None:
    """tool_choice checked: "none", "auto", "required", or {"type": "function", "function":
    {"name": ...}} (returned as given)."""
    if value is None or (isinstance(value, str) and value in CHOICES):
        return value
    named = isinstance(value, dict) and set(value) == {"type", "function"}
    named = named and value["type"] == "function" and isinstance(value["function"], dict)
    if named and set(value["function"]) == {"name"} and isinstance(value["function"]["name"], str):
        return value
    raise ValueError(
        "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    )


@dataclass
class ToolPlan:
    """How a chat request uses its tools: `tools` for the chat template (OpenAI's form),
    `names` the functions a call may name (an answer's calls are parsed only when `parse`), and
    `grammar` the llguidance grammar that enforces a call (None: the model is free)."""

    tools: list[dict[str, Any]]
    names: list[str]
    parse: bool
    grammar: str | None = None


async def plan_tools(
    tools: list[Tool] | None, choice: str | dict | None, grammars: Grammars
) -> ToolPlan | None:
    """The request's ToolPlan (None without tools), every function's schema compiled (once per
    schema, by `grammars`), and for "required" or a named function the grammar of one call,
    compiled once per (tools, choice). ToolError names the field at fault."""
    if not tools:
        if choice in (None, "none", "auto"):
            return None
        raise ToolError("tool_choice", f"tool_choice {_show(choice)} needs 'tools'")
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    functions = [tool.function for tool in tools]
    seen: set[str] = set()
    for i, function in enumerate(functions):
        if function.name in seen:
            message = f"two tools are named {function.name!r}: each name must be unique"
            raise ToolError(f"tools[{i}].function.name", message)
        seen.add(function.name)
        try:
            await grammars.schema(function.arguments_schema())
        except SchemaError as e:
            raise ToolError(f"tools[{i}].function.parameters", f"invalid parameters: {e}") from e
    names = [f.name for f in functions]
    plan = ToolPlan([t.model_dump(exclude_none=True) for t in tools], names, choice != "none")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            message = f"tool_choice names the function {name!r}, which is not one of the tools"
            raise ToolError("tool_choice", f"{message} ({', '.join(names)})")
        functions = [f for f in functions if f.name == name]
    elif choice != "required":
        return plan
    try:
        plan.grammar = await grammars.lark(call_grammar(functions))
    except SchemaError as e:
        raise ToolError("tools", f"the tools cannot be enforced: {e}") from e
    return plan


def call_grammar(functions: list[FunctionDef]) -> str:
    """The Lark grammar of one call to one of `functions`: the block in Qwen3's format, the
    function's name fixed, its arguments JSON that fits its schema."""
    rules = [f"start: {' | '.join(f'call_{i}' for i in range(len(functions)))}"]
    for i, function in enumerate(functions):
        head, tail = call_block(function.name, "\0").split("\0")  # around the arguments
        schema = {**function.arguments_schema(), "x-guidance": ARGUMENT_JSON}
        rules.append(
            f"call_{i}: {_lark_string(head)} %json {json.dumps(schema)} {_lark_string(tail)}"
        )
    return "\n".join(rules)


def _lark_string(text: str) -> str:
    """A Lark string literal (JSON's escapes, which Lark's strings read the same)."""
    return json.dumps(text)


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else json.dumps(choice)

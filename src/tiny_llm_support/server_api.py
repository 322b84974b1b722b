"""The OpenAI wire format of serve.py's requests: their bodies checked with pydantic, and the
JSON of errors (ApiError). The JSON of answers, whole or streamed, is server_replies'.

Every check here runs before a request reaches the engine, so a refused request costs the engine
nothing. A field the server does not implement is refused by name rather than ignored: a client
that asks for `logit_bias` or `presence_penalty` and silently gets none would be misled. Clients
do send some of those fields with the value that means "off" (`presence_penalty: 0`,
`logit_bias: {}`, ...); NEUTRAL lists the values that are accepted for that reason.

Week 4 Day 8 added what agents and evaluators ask for: logprobs (and completions' echo, with
max_tokens 0 for a prompt scored alone) and response_format, whose wire formats are
server_formats'; `n` answers to each prompt (best_of only equal to n); and on chat, tools
(server_tools: `tools`, `tool_choice`; server_messages: the tool-calling turns a conversation
sends back).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import (
    Field,
    ValidationError,
    field_validator,
)

from .server_formats import ResponseFormat, StrictBody
from .server_messages import ChatMessage
from .server_tools import Tool, tool_choice

MAX_SEED = 2**64 - 1
MAX_COUNT = 2**31 - 1  # max_tokens, top_k: what any int32 counter of an engine can hold
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # each step looks for every stop string in the new text
MAX_PROMPTS = 32  # the prompts of one completion request, each an engine request of its own
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit); completions' (OpenAI 5, vLLM 20)
MAX_CHOICES = 16  # n: answers to one prompt (the engine's MAX_CHOICES), each a decode slot

# field -> (values that leave the output unchanged, why another value is refused). A field that
# the endpoint's body declares (chat's top_logprobs, completions' echo) is that body's, not this.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_logprobs": ((0,), "on /v1/completions, 'logprobs': k asks for the k most likely tokens"),
    "echo": ((False,), "a chat answer does not repeat the conversation (a completion's does)"),
    "presence_penalty": ((0,), "this server has no presence penalty"),
    "frequency_penalty": ((0,), "this server has no frequency penalty"),
    "logit_bias": (({},), "this server does not bias logits"),
    "tools": (([],), "tools are offered on /v1/chat/completions"),
    "tool_choice": (("none",), "tools are offered on /v1/chat/completions"),
    "functions": (([],), "the deprecated 'functions' are sent as 'tools' now"),
    "function_call": (("none",), "the deprecated 'function_call' is sent as 'tool_choice' now"),
    "parallel_tool_calls": ((True, False), "tools are offered on /v1/chat/completions"),
    "modalities": ((["text"],), "this server only writes text"),
    "store": ((False,), "this server stores nothing"),
    "suffix": (("",), "this server does not insert text before a suffix"),
}


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict[str, Any]:
        """{"error": {message, type, param, code}}, what OpenAI's clients parse."""
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": {**error, "code": self.code}}


class StreamOptions(StrictBody):
    include_usage: bool = False


class _Generation(StrictBody):
    """What both endpoints take: sampling, limits, stop strings, streaming."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1, le=MAX_COUNT)  # not OpenAI's; vLLM and mlx-lm take it
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Any = ()
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # answers to each prompt
    best_of: int | None = None  # OpenAI's older n: accepted only equal to n
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # not OpenAI's: fixed-length answers for load tests (as vLLM)
    user: str | None = None  # an end-user id for the operator's logs; it changes no output
    response_format: ResponseFormat | None = None  # OpenAI's on chat; vLLM's on completions too

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: Any) -> tuple[str, ...]:
        """None, a string or a list of strings, each non-empty; always a tuple."""
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if not all(stops):
            raise ValueError("a stop string must not be empty")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each "
                "(every step of the engine looks for each of them)"
            )
        return tuple(stops)

    @property
    def limit(self) -> int | None:
        """The most tokens to generate (None: up to the context's end)."""
        return self.max_tokens

    @property
    def echoes(self) -> bool:
        """Whether the answer starts with the prompt (completions' echo)."""
        return False

    def top_k_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None for none, else the number of top tokens with each."""
        return None

    def choices(self) -> int:
        """n: answers to each prompt (default 1). best_of, which would pick the likeliest n of
        best_of answers, is refused unless it equals n (then it changes nothing)."""
        n = self.n or 1
        if self.best_of is not None and self.best_of != n:
            raise ApiError(
                400,
                f"'best_of' {self.best_of} is not supported: the server returns every answer "
                f"it generates; send n = {self.best_of} instead (or best_of = n)",
                "best_of",
            )
        return n


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # accepted; an enforced answer is one call

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any) -> Any:
        return tool_choice(choice)

    @property
    def limit(self) -> int | None:
        """max_completion_tokens, OpenAI's newer name, or else max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def top_k_logprobs(self) -> int | None:
        """logprobs: true, with top_logprobs (0 if left out); top_logprobs alone is refused
        (OpenAI's rule), unless it is 0, which asks for nothing."""
        if self.logprobs:
            return self.top_logprobs or 0
        if self.top_logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true too", "top_logprobs")
        return None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [m.for_template() for m in self.messages]


class CompletionRequest(_Generation):
    prompt: Any
    # 0 only with echo: the prompt scored (lm-evaluation-harness's loglikelihood), no generation
    max_tokens: int | None = Field(None, ge=0, le=MAX_COUNT)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, logprobs: Any) -> Any:
        """logprobs: false, which clients send for "none" (it was accepted as such before)."""
        return None if logprobs is False else logprobs

    @property
    def echoes(self) -> bool:
        return bool(self.echo)

    def top_k_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        """One prompt (text or token ids) or a list of them, each answered as a choice of its
        own (LangChain always sends a list); always a list here."""
        one = lambda p: (
            isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))
        )
        if one(prompt):
            return [prompt]
        if not isinstance(prompt, list) or not prompt or not all(one(p) for p in prompt):
            raise ValueError("must be a string, a list of token ids, or a non-empty list of those")
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
        return prompt


def sampling_settings(body: _Generation, grammar: str | None = None) -> dict[str, Any]:
    """SamplingParams' keywords for a request (`grammar`: its response_format's, compiled by
    server_formats.Grammars). The defaults are OpenAI's (temperature 1, top_p 1): a client that
    wants greedy text sends temperature 0. max_tokens 0 (echo only) becomes 1 here: such a
    request generates nothing, and its settings are only checked."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "'stream_options' is only allowed with stream: true", "stream_options")
    if body.limit == 0 and not body.echoes:
        raise ApiError(
            400,
            "invalid 'max_tokens': 0 generates nothing, which only echo: true asks for (the "
            "prompt alone, scored with logprobs); send 1 or more",
            param="max_tokens",
        )
    return {
        "max_tokens": body.limit or (1 if body.limit == 0 else None),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stop": body.stop,
        "ignore_eos": body.ignore_eos,
        "logprobs": body.top_k_logprobs(),
        "grammar": grammar,
    }


def parse_request(raw: bytes, kind: type[StrictBody]) -> Any:
    """The request body as `kind`, or ApiError(400) naming the field at fault."""
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # NaN, Infinity, -Infinity: Python's extensions, not JSON
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    where = _lone_surrogate(data)
    if where is not None:
        raise ApiError(
            400,
            f"invalid '{where}': holds a lone surrogate (\\ud800-\\udfff), which is not text",
            param=where,
        )
    try:
        return kind.model_validate(_without_neutral(data, set(kind.model_fields)))
    except ValidationError as e:
        raise _first_problem(e) from None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _lone_surrogate(data: Any) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, which JSON's \\u escapes
    can write but no tokenizer can read; None if there is none. Walks without recursion (the
    parser has bounded the depth, not the width)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{_printable(key)}".lstrip(".")
                if _has_surrogate(key):
                    return path
                stack.append((path, item))
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", item) for i, item in enumerate(value)]
        elif isinstance(value, str) and _has_surrogate(value):
            return where
    return None


def _printable(text: str) -> str:
    """The text with each lone surrogate written as its escape (\\ud800), so that it can go
    into an error message."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _without_neutral(data: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """The body less the unsupported fields sent with a value that changes nothing; an
    unsupported field with any other value is refused here, by name. `fields`: the body's own,
    which NEUTRAL does not apply to."""
    kept = {}
    for name, value in data.items():
        if name not in NEUTRAL or name in fields:
            kept[name] = value
        elif not _is_neutral(value, NEUTRAL[name][0]):
            raise ApiError(400, f"'{name}' is not supported: {NEUTRAL[name][1]}", param=name)
    return kept


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """None, or equal to a neutral value of the same kind (true is not 1 here)."""
    same = lambda a, b: a == b and isinstance(a, bool) == isinstance(b, bool)
    return value is None or any(same(value, n) for n in neutral)


def _first_problem(error: ValidationError) -> ApiError:
    """One ApiError for pydantic's first error: which field, and what is wrong with it."""
    problem = error.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in problem["loc"])
    where = where.lstrip(".")
    if problem["type"] == "extra_forbidden":
        message = f"'{where}' is not a field this server supports"
    elif problem["type"] == "missing":
        message = f"'{where}' is required"
    else:
        detail = problem["msg"].removeprefix("Value error, ")
        message = f"invalid '{where}': {detail[:1].lower()}{detail[1:]}"
    return ApiError(400, message, param=where or None)

"""serve.py against hostile input (issue 40): every field of both endpoints at its extremes, by
kind rather than by instance.

For each field of /v1/chat/completions and /v1/completions (model, messages and their role,
content, text parts and name, prompt in each of its forms, the limits, the sampling settings,
stop, stream, stream_options, ignore_eos, user, logprobs, top_logprobs, echo, response_format, n,
chat's tools (a tool's name, description and parameters), tool_choice and the tool-calling turns
of a conversation, and the OpenAI fields accepted only at their off values, server_api.NEUTRAL),
the kinds of value a client can send: integers from -2**63-1 to 10**30, floats from 5e-324 to
1e999 with NaN and the infinities (raw JSON tokens, which Python's json reads though they are
not JSON), empty, huge (500 KB), lone-surrogate, NUL, emoji and 10,000-newline strings, the
wrong types, JSON nested 100,000 deep, an empty or non-UTF-8 body, and 5,000 messages. Each
body is written as raw bytes, so that a value goes on the wire exactly as listed.

The contract of every case: the answer is a success (200 and a well-formed OpenAI object, or for
stream: true server-sent events whose data lines are JSON chunks, ending with `data: [DONE]`) or
an OpenAI error (a 4xx, never a 5xx, with the JSON body {"error": {message, type, param,
code}}, whose `param` names the field where the case knows it); and afterwards the server is
alive (GET /health answers 200 and a small greedy completion succeeds). A server a case kills is
started again for the next case, so that only the case that killed it fails.

Besides the table: the forms clients really send, through the official `openai` client (a
message's `name`, an assistant message with null content, a prompt as a list of strings,
extreme but valid sampling settings); the API key in any case of "Bearer"; HEAD on /health and
/metrics; Cache-Control: no-cache on event streams; and a client that sends only part of its
body, which must not hold its connection open for ever.

Support code like tests/test_serve.py, whose Server and request() are used here (serve.py in a
subprocess on a free port of 127.0.0.1, the shipped tiny model, the reference package). Every
request that may succeed generates at most 4 tokens (a request with a large max_tokens gets a
prompt that leaves room for 3).
"""

import copy
import json
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest
from test_serve import API_KEY, MAX_SEQ_LEN, MODEL, Server, request

from tiny_llm_support import resolve_model
from tiny_llm_support.tokenizer import load_tokenizer

FLAGS = ["--max-seq-len", str(MAX_SEQ_LEN), "--batch-size", "4"]
FLAGS += ["--page-size", "16", "--max-pages", "64"]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
NAMES = {CHAT: "chat", TEXT: "text"}
HI = [{"role": "user", "content": "Hi"}]
BASE = {
    CHAT: {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0},
    TEXT: {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
}
SMALL = BASE[TEXT]  # the completion that shows the engine still works
ANY = object()  # a param the case does not check (the body cannot be read, say)
HOLE = "@@hole@@"
TIMEOUT = 60  # seconds, for each raw request

TOKENIZER = load_tokenizer(resolve_model(MODEL))
VOCAB = TOKENIZER.vocab_size


def chat_tokens(content: str) -> int:
    messages = [{"role": "user", "content": content}]
    return len(TOKENIZER.encode(TOKENIZER.apply_chat_template(messages)))


def chat_content_of(n: int) -> str:
    """A user message that the chat template makes exactly n tokens ("a " is one token)."""
    guess = 10 + n - chat_tokens("a " * 10)
    for k in sorted(range(max(0, guess - 5), guess + 6), key=lambda k: abs(k - guess)):
        if chat_tokens("a " * k) == n:
            return "a " * k
    raise AssertionError(f"no run of 'a ' makes a chat prompt of {n} tokens")


def ids_of(n: int) -> list[int]:
    return [100 + i % 1000 for i in range(n)]


# Prompts that leave room for 3 tokens, for the cases whose max_tokens is large.
ROOMY = {
    CHAT: {
        **BASE[CHAT],
        "messages": [{"role": "user", "content": chat_content_of(MAX_SEQ_LEN - 3)}],
    },
    TEXT: {**BASE[TEXT], "prompt": ids_of(MAX_SEQ_LEN - 3)},
}
SAMPLED = {path: {**BASE[path], "temperature": 1} for path in BASE}

# --- the kinds of value, as raw JSON ----------------------------------------------------------

INTS = [
    ("0", 0), ("-1", -1), ("1", 1), ("2^31-1", 2**31 - 1), ("2^31", 2**31),
    ("2^53+1", 2**53 + 1), ("2^63-1", 2**63 - 1), ("2^63", 2**63), ("2^64-1", 2**64 - 1),
    ("2^64", 2**64), ("10^30", 10**30), ("-2^63-1", -(2**63) - 1),
]  # fmt: skip
INTS = [(label, str(value).encode()) for label, value in INTS]
LARGE_INTS = {"2^31-1", "2^31", "2^53+1", "2^63-1", "2^63", "2^64-1", "2^64", "10^30"}
FLOATS = [
    (text, text.encode())
    for text in [
        "0.0", "-0.0", "5e-324", "1e-45", "1e-30", "1e-8", "2.0", "2.0000001", "1e308",
        "1.7976931348623157e308", "NaN", "Infinity", "-Infinity", "1e999",
    ]
]  # fmt: skip
NON_FINITE = {"NaN", "Infinity", "-Infinity", "1e999"}
EMOJI = "👩‍👩‍👧‍👦 👍🏽 🇺🇳 e\u0301 Z\u0338\u0321\u031b\u0353 \u202eevil\u202c ﷽ 𝕳"
HUGE = "word " * 100_000  # 500 KB
STRINGS = [
    ("empty", b'""'),
    ("huge", json.dumps(HUGE).encode()),
    ("surrogate", b'"\\ud800"'),
    ("nul", b'"\\u0000"'),
    ("emoji", json.dumps(EMOJI, ensure_ascii=False).encode()),
    ("newlines", b'"' + b"\\n" * 10_000 + b'"'),
]
WRONG = [
    ("null", b"null"),
    ("true", b"true"),
    ("list", b"[1]"),
    ("object", b'{"a": 1}'),
    ("number", b"7"),
    ("string", b'"7"'),
]
DEEP = b"[" * 100_000 + b"]" * 100_000


@dataclass
class Case:
    id: str
    path: str
    body: bytes
    expect: str  # "ok", "error" or "either"
    param: Any = ANY  # the error's param: a name, a tuple of names, or ANY
    stream: bool = False


def body_with(base: dict, where: tuple, raw: bytes) -> bytes:
    """`base` as JSON with the value at `where` (keys and indices) replaced by `raw`."""
    body = copy.deepcopy(base)
    target = body
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = HOLE
    text = json.dumps(body).encode()
    assert text.count(f'"{HOLE}"'.encode()) == 1
    return text.replace(f'"{HOLE}"'.encode(), raw)


def case(path, where, label, raw, expect, param=ANY, base=None) -> Case:
    where = (where,) if isinstance(where, str) else where
    base = BASE[path] if base is None else base
    name = "".join(f"[{w}]" if isinstance(w, int) else f".{w}" for w in where).lstrip(".")
    stream = bool(base.get("stream")) or (where == ("stream",) and raw == b"true")
    return Case(f"{NAMES[path]}-{name}-{label}", path, body_with(base, where, raw), expect, param,
                stream)  # fmt: skip


def raw_case(path, label, body: bytes, expect, param=ANY) -> Case:
    return Case(f"{NAMES[path]}-{label}", path, body, expect, param)


# --- the table --------------------------------------------------------------------------------


# a neutral field takes fewer values of each kind: all but its off value go the same way
FEW = {"0", "1", "-1", "2^63", "2^64", "10^30", "0.0", "-0.0", "5e-324", "2.0", "NaN",
       "Infinity", "1e999", "int-0", "int-1", "null", "true", "string", "object"}  # fmt: skip


def param_of(field: str, label: str) -> Any:
    """NaN and the infinities are not JSON: a server may refuse the whole body (param null)
    rather than the field that holds them."""
    return (field, None) if label.removeprefix("id-") in ("NaN", "Infinity", "-Infinity") else field


def few(values, only: bool):
    return [(label, raw) for label, raw in values if not only or label in FEW]


def int_field(path, field, ok, error, large, base=None, neutral=False):
    """An integer field: INTS, the floats that are not integers, the wrong types."""
    cases = []
    for label, raw in few(INTS, neutral):
        expect = "ok" if label in ok else "error" if label in error else large
        cases.append(case(path, field, label, raw, expect, field, base))
    not_ints = [("2.0", b"2.0"), ("NaN", b"NaN"), ("Infinity", b"Infinity"),
                ("1e999", b"1e999"), ("1e308", b"1e308")]  # fmt: skip
    for label, raw in few(not_ints, neutral):
        cases.append(case(path, field, label, raw, "error", param_of(field, label), base))
    for label, raw in few(WRONG, neutral):
        if label != "number":
            cases.append(case(path, field, label, raw, "ok" if label == "null" else "error",
                              field, base))  # fmt: skip
    return cases


def float_field(path, field, expect_of, base=None, neutral=False):
    floats = FLOATS + [("int-0", b"0"), ("int-1", b"1"), ("int-2^64", b"18446744073709551616")]
    cases = []
    for label, raw in few(floats, neutral):
        cases.append(case(path, field, label, raw, expect_of(label), param_of(field, label), base))
    for label, raw in few(WRONG, neutral):
        if label != "number":
            cases.append(case(path, field, label, raw, "ok" if label == "null" else "error",
                              field, base))  # fmt: skip
    return cases


def temperature(label):
    if label in NON_FINITE:
        return "error"
    return "ok" if label in {"0.0", "-0.0", "2.0", "int-0", "int-1"} else "either"


def top_p(label):
    if label in NON_FINITE or label in {"0.0", "-0.0", "int-0", "int-2^64"}:
        return "error"
    if label in {"2.0", "2.0000001", "1e308", "1.7976931348623157e308"}:
        return "error"
    return "ok" if label == "int-1" else "either"


def penalty(label):
    return "ok" if label in {"0.0", "-0.0", "int-0"} else "error"


def string_field(path, where, expect_of, param, base=None, wrong=True, skip_wrong=("string",)):
    cases = [case(path, where, label, raw, expect_of(label), param, base) for label, raw in STRINGS]
    if wrong:
        for label, raw in WRONG:
            if label not in skip_wrong:
                cases.append(case(path, where, label, raw, expect_of(label), param, base))
    return cases


def user_expect(label):
    if label == "surrogate":
        return "either"
    return "ok" if label in dict(STRINGS) or label == "null" else "error"


def name_expect(label):
    return "either" if label in dict(STRINGS) or label == "null" else "error"


def text_expect(label):
    """A message's content or a prompt: refused when empty, only whitespace, past the context
    or not Unicode."""
    return {"nul": "either", "emoji": "ok", "string": "ok"}.get(label, "error")


def common_fields(path) -> list[Case]:
    """What both endpoints take."""
    cases = []
    # model
    cases += string_field(path, "model", lambda _: "error", "model")
    cases.append(case(path, "model", "deep", DEEP, "error"))
    # limits
    cases += int_field(path, "max_tokens", {"1"}, {"0", "-1", "-2^63-1"}, "either", ROOMY[path])
    # sampling
    cases += float_field(path, "temperature", temperature)
    cases += float_field(path, "top_p", top_p, SAMPLED[path])
    cases += int_field(path, "top_k", {"1"}, {"0", "-1", "-2^63-1"}, "either", SAMPLED[path])
    seed_ok = {"0", "1", "2^31-1", "2^31", "2^53+1", "2^63-1", "2^63"}
    seed_error = {"-1", "2^64", "10^30", "-2^63-1"}
    cases += int_field(path, "seed", seed_ok, seed_error, "either", SAMPLED[path])
    # stop, as a string and in a list (at most 16 of at most 256 characters: each step looks
    # for every one of them, and a 500 KB stop string stalled every request for seconds)
    stop_ok = {"nul", "emoji", "null"}
    cases += string_field(
        path, "stop", lambda lb: "ok" if lb in stop_ok else "error", ("stop", "stop[0]")
    )
    cases += string_field(
        path,
        ("stop", 0),
        lambda lb: "ok" if lb in stop_ok - {"null"} else "error",
        ("stop", "stop[0]"),
        base={**BASE[path], "stop": [HOLE]},
        wrong=False,
    )
    for label, raw in [("list-of-number", b"[7]"), ("list-of-null", b"[null]"),
                       ("list-of-list", b"[[]]"), ("empty-list", b"[]")]:  # fmt: skip
        cases.append(case(path, "stop", label, raw, "ok" if label == "empty-list" else "error",
                          "stop"))  # fmt: skip
    many = json.dumps([f"stop{i}" for i in range(1000)]).encode()
    cases.append(case(path, "stop", "1000-strings", many, "error", "stop"))
    cases.append(case(path, "stop", "deep", DEEP, "error"))
    # stream, stream_options, ignore_eos, user
    for label, raw, expect in [("true", b"true", "ok"), ("false", b"false", "ok"),
                               ("null", b"null", "ok"), ("string", b'"true"', "error"),
                               ("int-1", b"1", "error"), ("int-0", b"0", "error"),
                               ("object", b"{}", "error")]:  # fmt: skip
        cases.append(case(path, "stream", label, raw, expect, "stream"))
    streamed = {**BASE[path], "stream": True}
    for label, raw, expect, param in [
        ("usage", b'{"include_usage": true}', "ok", "stream_options"),
        ("no-usage", b'{"include_usage": false}', "ok", "stream_options"),
        ("null", b"null", "ok", "stream_options"),
        ("empty", b"{}", "ok", "stream_options"),
        ("usage-string", b'{"include_usage": "yes"}', "error", "stream_options.include_usage"),
        ("usage-null", b'{"include_usage": null}', "either", "stream_options.include_usage"),
        ("unknown-key", b'{"continuous_usage_stats": true}', "either",
         "stream_options.continuous_usage_stats"),
        ("list", b"[]", "error", "stream_options"),
        ("true", b"true", "error", "stream_options"),
        ("deep", DEEP, "error", ANY),
    ]:  # fmt: skip
        cases.append(case(path, "stream_options", label, raw, expect, param, streamed))
    cases.append(
        case(path, "stream_options", "without-stream", b'{"include_usage": true}', "error",
             "stream_options")
    )  # fmt: skip
    for label, raw, expect in [("true", b"true", "ok"), ("false", b"false", "ok"),
                               ("null", b"null", "either"), ("int-1", b"1", "error"),
                               ("string", b'"true"', "error")]:  # fmt: skip
        cases.append(case(path, "ignore_eos", label, raw, expect, "ignore_eos"))
    cases += string_field(path, "user", user_expect, "user")
    cases.append(case(path, "user", "deep", DEEP, "error"))
    # the neutral fields: their off values pass, any other is refused by name (top_logprobs
    # alone too: chat's needs logprobs: true, and completions have logprobs: k instead)
    for field in ("n", "best_of", "top_logprobs"):
        off = {"0"} if field == "top_logprobs" else {"1"}
        cases += int_field(path, field, off, set(), "error", neutral=True)
    cases += float_field(path, "presence_penalty", penalty, neutral=True)
    cases += float_field(path, "frequency_penalty", penalty, neutral=True)
    for field, off, other, other_expect in [
        ("echo", b"false", b"true", "ok" if path == TEXT else "error"),  # a completion's field
        ("logit_bias", b"{}", b'{"1": 5}', "error"),
        ("tools", b"[]", b'[{"type": "function"}]', "error"),
        ("tool_choice", b'"none"', b'"required"', "error"),  # "required" without tools
        ("functions", b"[]", b'[{"name": "f"}]', "error"),
        ("function_call", b'"none"', b'"auto"', "error"),
        ("parallel_tool_calls", b"false", b'"yes"', "error"),
        ("response_format", b'{"type": "text"}', b'{"type": "json_object"}', "ok"),
        ("modalities", b'["text"]', b'["audio"]', "error"),
        ("store", b"false", b"true", "error"),
        ("suffix", b'""', b'"x"', "error"),
    ]:
        cases.append(case(path, field, "off", off, "ok", field))
        cases.append(case(path, field, "null", b"null", "ok", field))
        other_param = "tools[0].function" if (path, field) == (CHAT, "tools") else field
        cases.append(case(path, field, "other", other, other_expect, other_param))
        cases.append(case(path, field, "deep", DEEP, "error"))
    cases += logprob_fields(path) + response_formats(path)
    # unknown fields
    for label, name in [("unknown", "frobnicate"), ("unknown-nul", "\\u0000"),
                        ("unknown-surrogate", "\\ud800"), ("unknown-huge", "k" * 500_000)]:  # fmt: skip
        body = json.dumps(BASE[path]).encode()[:-1] + b', "' + name.encode() + b'": 1}'
        cases.append(raw_case(path, f"field-{label}", body, "error"))
    # the whole body
    base = json.dumps(BASE[path]).encode()
    number = b"1" + b"0" * 5000
    for label, body in [
        ("body-deep-list", DEEP),
        ("body-deep-object", b'{"a": ' * 50_000 + b"1" + b"}" * 50_000),
        ("body-empty", b""),
        ("body-null", b"null"),
        ("body-string", b'"x"'),
        ("body-number", b"7"),
        ("body-not-utf8", base[:-1] + b', "user": "caf\xe9"}'),
        ("body-garbage", b"\x80\x81\xfe\xff"),
        ("body-5000-digit-number", base[:-1] + b', "max_tokens": ' + number + b"}"),
        ("body-5000-digit-float", base[:-1] + b', "temperature": ' + number + b".5}"),
    ]:
        cases.append(raw_case(path, label, body, "error"))
    cases.append(raw_case(path, "body-utf8-bom", b"\xef\xbb\xbf" + base, "either"))
    cases.append(raw_case(path, "body-utf16", json.dumps(BASE[path]).encode("utf-16"), "either"))
    return cases


def logprob_fields(path) -> list[Case]:
    """Chat's logprobs (a boolean) with top_logprobs 0..20; completions' logprobs 0..20 (false:
    none). Every value asks for at most 20 entries a token."""
    cases = []
    if path == CHAT:
        for label, raw, expect in [("true", b"true", "ok"), ("false", b"false", "ok"),
                                   ("null", b"null", "ok"), ("int-0", b"0", "error"),
                                   ("int-1", b"1", "error"), ("string", b'"true"', "error"),
                                   ("object", b"{}", "error")]:  # fmt: skip
            cases.append(case(path, "logprobs", label, raw, expect, "logprobs"))
        asked = {**BASE[CHAT], "logprobs": True}
        for c in int_field(path, "top_logprobs", {"0", "1"}, set(), "error", asked, neutral=True):
            c.id = c.id.replace("-top_logprobs-", "-top_logprobs-with-logprobs-")
            cases.append(c)
        name = "top_logprobs"
    else:
        cases += int_field(path, "logprobs", {"0", "1"}, set(), "error", neutral=True)
        cases.append(case(path, "logprobs", "false", b"false", "ok", "logprobs"))
        asked, name = BASE[TEXT], "logprobs"
    for label, raw, expect in [("20", b"20", "ok"), ("21", b"21", "error")]:
        cases.append(case(path, name, f"asked-{label}", raw, expect, name, asked))
    return cases


def response_formats(path) -> list[Case]:
    """response_format's JSON schemas, good and bad: a schema llguidance cannot follow is a
    400 naming response_format, never a 5xx."""
    schema = lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    huge_enum = {"enum": [f"value number {i}" for i in range(20_000)]}
    cases = []
    for label, value, expect, param in [
        ("schema", schema({"type": "object"}), "ok", "response_format"),
        ("huge-enum", schema(huge_enum), "ok", "response_format"),
        ("schema-absent", {"type": "json_schema", "json_schema": {"name": "x"}}, "ok", ANY),
        ("bad-type", schema({"type": "bogus"}), "error", "response_format"),
        ("unsupported", schema({"type": "array", "uniqueItems": True}), "error",
         "response_format"),
        ("unsatisfiable", schema({"type": "integer", "minimum": 2, "maximum": 1}), "error",
         "response_format"),
        ("bad-regex", schema({"type": "string", "pattern": "(("}), "error", "response_format"),
        ("bad-ref", schema({"$ref": "#/nowhere"}), "error", "response_format"),
        ("nested-200", schema(deep), "either", "response_format"),
        ("schema-list", schema([1]), "error", "response_format.json_schema.schema"),
        ("no-json_schema", {"type": "json_schema"}, "error", "response_format"),
        ("unknown-type", {"type": "yaml"}, "error", "response_format.type"),
        ("bad-name", {"type": "json_schema", "json_schema": {"name": "a b"}}, "error",
         "response_format.json_schema.name"),
        ("extra-key", {"type": "json_object", "x": 1}, "error", "response_format.x"),
    ]:  # fmt: skip
        raw = json.dumps(value).encode()
        cases.append(case(path, "response_format", label, raw, expect, param))
    return cases


def chat_fields() -> list[Case]:
    cases = []
    roomy = ROOMY[CHAT]
    cases += int_field(CHAT, "max_completion_tokens", {"1"}, {"0", "-1", "-2^63-1"}, "either",
                       roomy)  # fmt: skip
    cases.append(case(CHAT, "max_tokens", "null-with-max_completion_tokens", b"null", "ok",
                      "max_tokens", {**BASE[CHAT], "max_completion_tokens": 2}))  # fmt: skip
    # messages
    for label, raw in [("null", b"null"), ("true", b"true"), ("string", b'"Hi"'),
                       ("object", b'{"role": "user", "content": "Hi"}'), ("number", b"7"),
                       ("empty", b"[]")]:  # fmt: skip
        cases.append(case(CHAT, "messages", label, raw, "error", "messages"))
    cases.append(case(CHAT, "messages", "deep", DEEP, "error"))
    many = json.dumps([{"role": "user", "content": "hi"}] * 5000).encode()
    cases.append(case(CHAT, "messages", "5000-messages", many, "error", "messages"))
    # a user message's null content may be refused as the message's fault (its role's)
    content_null = ("messages[0].content", "messages[0]", "messages")
    cases.append(case(CHAT, ("messages", 0, "content"), "null", b"null", "error", content_null))
    for label, raw in [("null", b"null"), ("string", b'"Hi"'), ("number", b"7"), ("list", b"[]"),
                       ("empty-object", b"{}")]:  # fmt: skip
        cases.append(case(CHAT, ("messages", 0), label, raw, "error",
                          ("messages[0]", "messages[0].role", "messages[0].content")))  # fmt: skip
    # role
    cases += string_field(CHAT, ("messages", 0, "role"), lambda _: "error", "messages[0].role",
                          skip_wrong=())  # fmt: skip
    for role, expect in [("system", "either"), ("developer", "either"), ("assistant", "either"),
                         ("User", "error"), ("tool", "error"), ("function", "error")]:  # fmt: skip
        raw = json.dumps(role).encode()
        # a tool message without the tool_call_id it needs: the message's fault
        param = "messages[0]" if role == "tool" else "messages[0].role"
        cases.append(case(CHAT, ("messages", 0, "role"), role, raw, expect, param))
    # content, as a string and as text parts
    content = ("messages[0].content", "messages")
    cases += string_field(CHAT, ("messages", 0, "content"), text_expect, content,
                          skip_wrong=("string", "null"))  # fmt: skip
    parts = {**BASE[CHAT], "messages": [{"role": "user", "content": [{"type": "text",
                                                                       "text": HOLE}]}]}  # fmt: skip
    cases += string_field(CHAT, ("messages", 0, "content", 0, "text"),
                          text_expect, ("messages[0].content[0].text",) + content,
                          base=parts)  # fmt: skip
    for label, raw, expect in [
        ("parts-empty", b"[]", "error"),
        (
            "parts-two",
            b'[{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]',
            "ok",
        ),
        ("part-null", b"[null]", "error"),
        ("part-string", b'["Hi"]', "either"),
        ("part-no-text", b'[{"type": "text"}]', "error"),
        ("part-text-null", b'[{"type": "text", "text": null}]', "error"),
        ("part-text-number", b'[{"type": "text", "text": 7}]', "error"),
        ("part-image", b'[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]', "error"),
        ("part-extra-key", b'[{"type": "text", "text": "Hi", "x": 1}]', "error"),
        ("part-deep", b"[" + DEEP + b"]", "error"),
        ("1000-parts", json.dumps([{"type": "text", "text": "word "}] * 1000).encode(), "error"),
    ]:
        param = ANY if "deep" in label else ("messages[0].content[0]",) + content
        cases.append(case(CHAT, ("messages", 0, "content"), label, raw, expect, param))
    # name, as LangChain's HumanMessage(name=...) sends it
    named = {**BASE[CHAT], "messages": [{"role": "user", "content": "Hi", "name": HOLE}]}
    cases += string_field(CHAT, ("messages", 0, "name"), name_expect, "messages[0].name",
                          base=named)  # fmt: skip
    cases.append(case(CHAT, ("messages", 0, "name"), "alice", b'"alice"', "ok",
                      "messages[0].name", named))  # fmt: skip
    # an assistant's null content in the history
    history = {**BASE[CHAT], "messages": [*HI, {"role": "assistant", "content": HOLE},
                                          {"role": "user", "content": "Again"}]}  # fmt: skip
    cases.append(case(CHAT, ("messages", 1, "content"), "assistant-null", b"null", "ok",
                      "messages[1].content", history))  # fmt: skip
    cases.append(case(CHAT, ("messages", 1, "content"), "assistant-empty", b'""', "ok",
                      "messages[1].content", history))  # fmt: skip
    # a chat prompt of exactly the context refused, one leaving room answered
    fits = json.dumps(chat_content_of(MAX_SEQ_LEN - 1)).encode()
    full = json.dumps(chat_content_of(MAX_SEQ_LEN)).encode()
    cases.append(case(CHAT, ("messages", 0, "content"), "max_seq_len-1-tokens", fits, "ok",
                      content))  # fmt: skip
    cases.append(case(CHAT, ("messages", 0, "content"), "max_seq_len-tokens", full, "error",
                      content))  # fmt: skip
    return cases


def text_fields() -> list[Case]:
    cases = []
    prompt = "prompt"
    prompt_expect = lambda lb: "ok" if lb == "list" else text_expect(lb)  # [1]: one token id  # noqa: E731
    cases += string_field(TEXT, "prompt", prompt_expect, prompt)
    cases.append(case(TEXT, "prompt", "float", b"1.5", "error", prompt))
    # a list of one string, as LangChain always sends it
    one = {**BASE[TEXT], "prompt": [HOLE]}
    cases += string_field(TEXT, ("prompt", 0), text_expect,
                          (prompt, "prompt[0]"), base=one, wrong=False)  # fmt: skip
    cases.append(case(TEXT, ("prompt", 0), "hi", b'"Hi"', "ok", prompt, one))
    # token ids
    ids = {**BASE[TEXT], "prompt": [5, HOLE]}
    for label, raw in INTS:
        expect = "ok" if label in ("0", "1") else "error"
        cases.append(case(TEXT, ("prompt", 1), f"id-{label}", raw, expect, prompt, ids))
    for label, raw, expect in [
        (f"id-{VOCAB - 1}", str(VOCAB - 1).encode(), "ok"),
        (f"id-{VOCAB}", str(VOCAB).encode(), "error"),
        ("id-true", b"true", "error"),
        ("id-1.0", b"1.0", "error"),
        ("id-NaN", b"NaN", "error"),
        ("id-string", b'"a"', "error"),
        ("id-null", b"null", "error"),
    ]:
        cases.append(case(TEXT, ("prompt", 1), label, raw, expect, param_of(prompt, label), ids))
    for label, raw, expect in [
        ("one-id-list", b"[[5, 6]]", "either"),
        ("two-id-lists", b"[[5], [6]]", "ok"),  # two choices
        ("list-of-list-of-string", b'[["Hi"]]', "error"),
        ("nested-3", b"[[[5]]]", "error"),
        ("two-strings", b'["one", "two"]', "ok"),
        ("33-strings", json.dumps(["hi"] * 33).encode(), "error"),
        ("string-and-id", b'["Hi", 5]', "error"),
        ("empty-list", b"[]", "error"),
        ("empty-inner-list", b"[[]]", "error"),
        ("5000-strings", json.dumps(["hi"] * 5000).encode(), "error"),
        ("5000-ids", json.dumps(ids_of(5000)).encode(), "error"),
        ("max_seq_len-1-ids", json.dumps(ids_of(MAX_SEQ_LEN - 1)).encode(), "ok"),
        ("max_seq_len-ids", json.dumps(ids_of(MAX_SEQ_LEN)).encode(), "error"),
        ("deep", DEEP, "error"),
    ]:
        cases.append(case(TEXT, "prompt", label, raw, expect, ANY if label == "deep" else prompt))
    return cases


def tool_fields() -> list[Case]:
    """Chat's tools (Week 4 Day 8): a tool's name, description and parameters schema, tool_choice,
    and the tool-calling turns of a conversation. One small tool fits the context (its system
    message is about 200 tokens), so a case whose text grows the prompt may be refused."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    base = {**BASE[CHAT], "tools": [tool]}
    where = lambda *rest: ("tools", 0, "function", *rest)
    cases = string_field(CHAT, where("name"), lambda _: "error", "tools[0].function.name", base)
    # a long description makes the prompt too long for the context: a 400 naming messages
    cases += string_field(CHAT, where("description"), lambda _: "either",
                          ("tools[0].function.description", "messages"), base)  # fmt: skip
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    for label, value, expect in [
        ("object", {"type": "object"}, "ok"),
        ("absent-type", {"properties": {"a": {"type": "integer"}}}, "ok"),
        ("string-type", {"type": "string"}, "error"),
        ("unsupported", {"type": "object", "properties": {"a": {"uniqueItems": True}}}, "error"),
        ("bad-ref", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "error"),
        ("nested-200", {"type": "object", "properties": {"a": deep}}, "either"),
        ("huge-enum", {"type": "object", "properties": {"a": {"enum": list(range(20_000))}}},
         "either"),
    ]:  # fmt: skip
        raw = json.dumps(value).encode()
        cases.append(case(CHAT, where("parameters"), label, raw, expect,
                          ("tools[0].function.parameters", "messages"), base))  # fmt: skip
    cases.append(case(CHAT, where("parameters"), "deep", DEEP, "error", ANY, base))
    many = json.dumps([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)])
    cases.append(case(CHAT, "tools", "129-tools", many.encode(), "error", "tools"))
    for label, raw, expect, param in [
        ("none", b'"none"', "ok", "tool_choice"), ("auto", b'"auto"', "ok", "tool_choice"),
        ("required", b'"required"', "ok", "tool_choice"),
        ("named", b'{"type": "function", "function": {"name": "f"}}', "ok", "tool_choice"),
        ("named-unknown", b'{"type": "function", "function": {"name": "g"}}', "error",
         "tool_choice"),
        ("named-null", b'{"type": "function", "function": {"name": null}}', "error",
         "tool_choice"),
        ("string", b'"always"', "error", "tool_choice"), ("int", b"1", "error", "tool_choice"),
        ("deep", DEEP, "error", ANY),
    ]:  # fmt: skip
        cases.append(case(CHAT, "tool_choice", f"with-a-tool-{label}", raw, expect, param, base))
    # a conversation that sends a call and its result back (the tools left out: it fits)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip
    history = {**BASE[CHAT], "messages": [*HI, *turns]}
    cases.append(case(CHAT, ("messages", 2, "content"), "tool-result", b'"42"', "ok",
                      "messages[2].content", history))  # fmt: skip
    call_id = ("messages[2].tool_call_id", "messages[2]", "messages")
    cases += string_field(CHAT, ("messages", 2, "tool_call_id"), lambda _: "either", call_id,
                          history)  # fmt: skip
    cases += string_field(CHAT, ("messages", 1, "tool_calls", 0, "function", "arguments"),
                          lambda _: "either", ("messages[1].tool_calls[0].function.arguments",
                                               "messages"), history)  # fmt: skip
    for label, raw in [("null", b"null"), ("empty", b"[]"), ("object", b"{}"), ("deep", DEEP)]:
        expect = "ok" if label in ("null", "empty") else "error"
        cases.append(case(CHAT, ("messages", 1, "tool_calls"), label, raw, expect, ANY, history))
    return cases


CASES = chat_fields() + tool_fields() + common_fields(CHAT) + text_fields() + common_fields(TEXT)
assert len({c.id for c in CASES}) == len(CASES), "two cases share an id"


# --- the contract -----------------------------------------------------------------------------


def header(headers: dict, name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


def check_answer(
    what: str,
    status: int,
    headers: dict,
    raw: bytes,
    expect: str = "either",
    param: Any = ANY,
    stream: bool = False,
    kind: str | None = None,
) -> None:
    """A success or an OpenAI error as `expect` says; AssertionError naming the case, the
    status and the start of the body otherwise."""
    seen = f"{what}: status {status}, body {raw[:300]!r}"
    if status == 200:
        assert expect in ("ok", "either"), f"an error was expected; {seen}"
        if stream:
            check_stream(seen, headers, raw, kind)
        else:
            check_object(seen, raw, kind)
        return
    assert 400 <= status < 500, f"not a success nor a 4xx; {seen}"
    assert expect in ("error", "either"), f"a success was expected; {seen}"
    try:
        body = json.loads(raw)
    except ValueError:
        raise AssertionError(f"the error is not JSON; {seen}") from None
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, (
        f"not an OpenAI error object; {seen}"
    )
    assert isinstance(error["message"], str) and error["message"], f"no message; {seen}"
    assert isinstance(error["type"], str) and error["type"], f"no type; {seen}"
    assert error["param"] is None or isinstance(error["param"], str), f"param; {seen}"
    assert error["code"] is None or isinstance(error["code"], str), f"code; {seen}"
    if param is not ANY:
        wanted = param if isinstance(param, tuple) else (param,)
        assert error["param"] in wanted, f"param {error['param']!r}, not one of {wanted}; {seen}"


OBJECT = {"chat": "chat.completion", "text": "text_completion"}


def check_object(seen: str, raw: bytes, kind: str | None) -> None:
    try:
        body = json.loads(raw)
    except ValueError:
        raise AssertionError(f"the answer is not JSON; {seen}") from None
    assert body.get("object") == OBJECT.get(kind, body.get("object")), f"object; {seen}"
    assert body["object"] in OBJECT.values() and isinstance(body.get("id"), str), seen
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and choices, seen
    for choice in choices:  # one per prompt of a completion, else one
        assert choice["finish_reason"] in ("stop", "length"), f"finish_reason; {seen}"
        chat = body["object"] == "chat.completion"
        text = choice["message"]["content"] if chat else choice["text"]
        assert isinstance(text, str), f"no text; {seen}"
    counts = body["usage"]
    assert counts["total_tokens"] == counts["prompt_tokens"] + counts["completion_tokens"], seen
    assert 1 <= counts["completion_tokens"] <= 4 * len(choices), f"more than 4 tokens; {seen}"


def check_stream(seen: str, headers: dict, raw: bytes, kind: str | None) -> None:
    content_type = header(headers, "content-type") or ""
    assert content_type.startswith("text/event-stream"), f"not an event stream; {seen}"
    lines = [line for line in raw.decode().split("\n") if line and not line.startswith(":")]
    assert all(line.startswith("data: ") for line in lines), f"not data lines; {seen}"
    data = [line.removeprefix("data: ") for line in lines]
    assert data and data[-1] == "[DONE]", f"the stream does not end with [DONE]; {seen}"
    for item in data[:-1]:
        try:
            chunk = json.loads(item)
        except ValueError:
            raise AssertionError(f"a data line is not JSON: {item[:100]!r}; {seen}") from None
        assert "error" not in chunk, f"an error in a stream that answered 200; {seen}"
        expected = {"chat": "chat.completion.chunk", "text": "text_completion"}
        assert chunk.get("object") == expected.get(kind, chunk.get("object")), seen


def assert_alive(server: Server, what: str) -> None:
    """/health answers 200 and a small greedy completion succeeds."""

    def died(reason: str) -> str:
        try:
            server.proc.wait(timeout=5)  # a server that is going: its last words
            tail = server.err.read_text()[-800:]
        except subprocess.TimeoutExpired:
            tail = ""
        return f"after {what}: {reason}" + (f"\nthe server's stderr ends:\n{tail}" if tail else "")

    try:
        status, _, raw = request(server.port, "GET", "/health", timeout=5)
    except OSError as e:
        raise AssertionError(died(f"GET /health failed: {e!r}")) from None
    assert status == 200, died(f"GET /health answered {status} {raw[:200]!r}")
    try:
        status, _, raw = request(server.port, "POST", TEXT, SMALL, timeout=30)
    except OSError as e:
        raise AssertionError(died(f"a small completion failed: {e!r}")) from None
    assert status == 200, died(f"a small completion answered {status} {raw[:300]!r}")


# --- servers ------------------------------------------------------------------------------------


class Servers:
    """One server for the module, started again when a case has killed it."""

    def __init__(self, factory, *flags: str) -> None:
        self.factory, self.flags = factory, flags
        self.current: Server | None = None
        self.starts = 0

    def live(self) -> Server:
        if self.current is None or not self._healthy(self.current):
            if self.current is not None:
                self.current.stop()
            self.current = Server(self.factory.mktemp("hostile"), *self.flags)
            self.starts += 1
        return self.current

    @staticmethod
    def _healthy(server: Server) -> bool:
        if server.proc.poll() is not None:
            return False
        try:
            return request(server.port, "GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    box = Servers(tmp_path_factory, *FLAGS)
    yield box
    box.close()


@pytest.fixture
def server(servers) -> Server:
    return servers.live()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    box = Servers(tmp_path_factory, *FLAGS, "--api-key", API_KEY)
    yield box
    box.close()


# --- the table's cases --------------------------------------------------------------------------


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_hostile_field(server, c: Case):
    try:
        status, headers, raw = request(server.port, "POST", c.path, c.body, timeout=TIMEOUT)
    except OSError as e:
        raise AssertionError(f"{c.id}: no answer: {e!r}") from None
    problems = []  # the answer's and the server's, both told when both fail
    for check in (
        lambda: check_answer(
            c.id, status, headers, raw, c.expect, c.param, c.stream, NAMES[c.path]
        ),
        lambda: assert_alive(server, c.id),
    ):
        try:
            check()
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


# --- what real clients send, through the official client ------------------------------------------


def test_client_message_name_and_null_assistant_content(server):
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi", "name": "alice"}],
        max_tokens=2,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(
        model=MODEL,
        messages=[*HI, {"role": "assistant", "content": None}, {"role": "user", "content": "Go"}],
        max_tokens=2,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert_alive(server, "the client's name and null content")


def test_client_prompt_as_a_list_of_one_string(server):
    r = server.client().completions.create(model=MODEL, prompt=["Hi"], max_tokens=2, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    assert_alive(server, "prompt=['Hi']")


SETTINGS = [
    {"temperature": 2.0},
    {"temperature": 0.0, "seed": 0},
    {"temperature": 1.0, "top_p": 1e-8},
    {"temperature": 1.0, "top_p": 1.0, "seed": 2**63 - 1},
    {"temperature": 1e-8, "seed": 2**53 + 1},
    {"temperature": 1.0, "extra_body": {"top_k": 1, "ignore_eos": True}},
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("settings", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_client_extreme_valid_settings(server, settings, stream):
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, stream=stream, **settings
    )
    text = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, stream=stream, **settings
    )
    if stream:
        chat, text = list(chat), list(text)
        assert chat[-1].choices[0].finish_reason in ("stop", "length")
        assert text[-1].choices[0].finish_reason in ("stop", "length")
    else:
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert 1 <= text.usage.completion_tokens <= 3
    assert_alive(server, f"the client with {settings}")


# --- the API key, HEAD, headers of streams, a body that never comes -------------------------------


AUTH = [
    ("Bearer", f"Bearer {API_KEY}", "ok"),
    ("bearer", f"bearer {API_KEY}", "ok"),
    ("BEARER", f"BEARER {API_KEY}", "ok"),
    ("none", None, "error"),
    ("empty", "", "error"),
    ("wrong-key", "Bearer wrong", "error"),
    ("no-scheme", API_KEY, "error"),
    ("scheme-only", "Bearer", "error"),
    ("basic", f"Basic {API_KEY}", "error"),
    ("two-spaces", f"Bearer  {API_KEY}", "either"),
    ("trailing-space", f"Bearer {API_KEY} ", "either"),
    ("long", "Bearer " + "k" * 8000, "error"),
    ("latin-1-byte", b"Bearer \xff", "error"),
]


@pytest.mark.parametrize("label, value, expect", AUTH, ids=[a[0] for a in AUTH])
def test_api_key_forms(keyed, label, value, expect):
    server = keyed.live()
    headers = {} if value is None else {"Authorization": value}
    for path in (CHAT, TEXT):
        status, got, raw = request(server.port, "POST", path, BASE[path], headers, TIMEOUT)
        check_answer(f"{path} with {label}", status, got, raw, expect, kind=NAMES[path])
        if status != 200:
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", raw
    status, _, raw = request(server.port, "GET", "/health", timeout=5)
    assert status == 200, f"after {label}: /health {status} {raw[:200]!r}"


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_head(server, path):
    status, _, raw = request(server.port, "HEAD", path, timeout=TIMEOUT)
    assert (status, raw) == (200, b""), f"HEAD {path}: status {status}, body {raw[:300]!r}"
    assert_alive(server, f"HEAD {path}")


@pytest.mark.parametrize("path", [CHAT, TEXT], ids=["chat", "text"])
def test_event_streams_are_not_cached(server, path):
    body = {**BASE[path], "stream": True}
    status, headers, raw = request(server.port, "POST", path, body, timeout=TIMEOUT)
    check_answer(f"{path} streamed", status, headers, raw, "ok", stream=True, kind=NAMES[path])
    assert header(headers, "cache-control") == "no-cache", f"{path}: headers {headers}"


def test_a_body_that_never_comes_is_not_waited_for_ever(server):
    """Content-Length 1000 and 10 bytes sent: within 60 s the server closes the connection or
    answers 408 or 400 (a few seconds' timeout is expected; 60 leaves room on a busy machine)."""
    limit, start = 60, time.monotonic()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        head = (
            f"POST {TEXT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model":"')
        sock.settimeout(1)
        received = b""
        while time.monotonic() - start < limit:
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset: closed
                break
            if not data:
                break
            received += data
            if b"\r\n" in received:
                status = received.split(b"\r\n", 1)[0]
                assert status.split()[1] in (b"408", b"400"), f"answered {received[:300]!r}"
                break
        else:
            raise AssertionError(f"the connection is still open after {limit} s")
    finally:
        sock.close()
    assert_alive(server, "a body that never came")

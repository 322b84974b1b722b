"""serve.py's tool calls (Week 4 Day 8) as a client sees them, and the small agent on top.

tool_choice "required" and a named function are enforced by a grammar, so even the shipped tiny
chat model (never taught to call tools) answers with one call; every call's arguments are
checked by an outside validator (`jsonschema`) against the function's parameters, greedy and
seeded, whole and streamed (the stream's deltas must join to the whole answer's call). "auto"
parses whatever the model writes (the tiny model writes text: no calls), "none" parses nothing;
a conversation that sends a call's result back is rendered in Qwen3's format (chat_format's
fallback: the tiny model's template knows no tools) and answered. Every bad input is a 400
naming its field and costs the engine nothing.

The parser of <tool_call> blocks and the fallback rendering are also checked without a server;
the agent (tiny_llm_support.agent) runs end to end, offline: against this file's server, and
starting a server of its own.

Support code like tests/test_serve.py (its Server and request()), with a longer context: the
tools' system message alone is a few hundred tokens of the tiny model's small vocabulary.
"""

import asyncio
import concurrent.futures
import json
import signal
import subprocess
import sys
import time

import jsonschema
import pytest
from helpers import offline_env
from test_serve import MODEL, ROOT, Server, request, wait_until

from tiny_llm_support import resolve_model
from tiny_llm_support.agent_tools import calculate, calculator
from tiny_llm_support.chat_format import render_with_tools
from tiny_llm_support.server_formats import Grammars, TokenTexts
from tiny_llm_support.server_tool_calls import ToolCallParser
from tiny_llm_support.server_tools import Tool, plan_tools
from tiny_llm_support.tokenizer import Tokenizer, load_tokenizer

CHAT = "/v1/chat/completions"
FLAGS = ["--max-seq-len", "1024", "--batch-size", "4", "--page-size", "16", "--max-pages", "256"]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# every string and number bounded and no extra keys: an enforced call by a tiny model finishes
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -999, "maximum": 999},
        "b": {"type": "integer", "minimum": -999, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
DIGIT = {  # a $ref: the schema must stay the root of its own JSON grammar
    "type": "object",
    "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
    "properties": {"d": {"$ref": "#/$defs/digit"}},
    "required": ["d"],
    "additionalProperties": False,
}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "digit", "parameters": DIGIT}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "digit": DIGIT, "now": NO_ARGUMENTS}
COUNTERS = ["tiny_llm_prompt_tokens_prefilled_total", "tiny_llm_kv_pages_in_use",
            "tiny_llm_requests_finished_total", "tiny_llm_requests_waiting"]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-tools"), *FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(MODEL))


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def chat(server, messages=QUESTION, stream=False, seed=None, **fields):
    """(content, tool calls as (name, arguments) pairs, finish_reason, the calls' ids, usage) of
    a chat answer, whole or streamed (its deltas joined)."""
    sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    r = server.client().chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=120, stream=stream,
        **sampling, **fields,
    )  # fmt: skip
    if not stream:
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        pairs = [(c.function.name, c.function.arguments) for c in calls]
        return choice.message.content, pairs, choice.finish_reason, [c.id for c in calls], r.usage
    content, calls, finish = None, {}, None
    for chunk in r:
        (choice,) = chunk.choices
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    ordered = [calls[i] for i in sorted(calls)]
    assert sorted(calls) == list(range(len(calls))), f"call indices {sorted(calls)}"
    pairs = [(c["name"], c["arguments"]) for c in ordered]
    return content, pairs, finish, [c["id"] for c in ordered], None


# --- enforced calls -------------------------------------------------------------------------

JOBS = [(choice, seed, stream) for choice in ["required", "get_weather", "add", "digit", "now"]
        for seed in (None, 7) for stream in (False, True)]  # fmt: skip


def test_enforced_calls_validate_whole_and_streamed(server):
    """Every job at once (four slots): one call, finish_reason tool_calls, null content, the
    arguments valid for the function; a stream's deltas join to the whole answer's call."""

    def run(job):
        choice, seed, stream = job
        tool_choice = choice if choice == "required" else named(choice)
        return chat(server, stream=stream, seed=seed, tool_choice=tool_choice)

    with concurrent.futures.ThreadPoolExecutor(len(JOBS)) as pool:
        answers = dict(zip(JOBS, pool.map(run, JOBS)))
    for (choice, seed, stream), (content, calls, finish, ids, _) in answers.items():
        what = f"tool_choice {choice!r}, {'greedy' if seed is None else f'seed {seed}'}"
        what += ", streamed" if stream else ""
        assert finish == "tool_calls" and len(calls) == 1, (
            f"{what}: finish {finish!r}, calls {calls}, content {content!r} (is the call's "
            "grammar the request's, and does a parsed call set finish_reason 'tool_calls'?)"
        )
        assert content is None, f"{what}: content {content!r} beside the call: null expected"
        assert ids[0].startswith("call_") and len(ids[0]) > 8, f"{what}: id {ids[0]!r}"
        name, arguments = calls[0]
        if choice != "required":
            assert name == choice, f"{what}: called {name!r}, not the function tool_choice names"
        try:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{what}: arguments {arguments!r} do not fit {name}'s "
                                 f"parameters: {e}") from None  # fmt: skip
        if stream:
            whole = answers[(choice, seed, False)][1]
            assert calls == whole, (
                f"{what}: the stream's deltas make {calls}, the whole answer {whole} (a "
                "stream must carry each call once, whole, with its index)"
            )


def test_tool_result_is_rendered_and_answered(server, tokenizer):
    """The call goes back as an assistant message with null content, its result as a tool
    message; the server renders them (Qwen3's format) and answers in text."""
    content, calls, _, ids, _ = chat(server, tool_choice=named("get_weather"))
    (name, arguments), call_id = calls[0], ids[0]
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 degrees"}]  # fmt: skip
    for choice in ("none", "auto"):
        content, calls, finish, _, usage = chat(server, messages, tool_choice=choice)
        assert isinstance(content, str) and content and not calls, (choice, content, calls)
        assert finish in ("stop", "length"), finish
        expected = render_with_tools(tokenizer, messages, [Tool(**t).model_dump(exclude_none=True)
                                                          for t in TOOLS])  # fmt: skip
        assert usage.prompt_tokens == len(tokenizer.encode(expected)), (
            "the prompt is not the conversation as chat_format renders it (the call and its "
            "result in Qwen3's format)"
        )
        assert "Sunny, 21 degrees" in expected and f'"name": "{name}"' in expected


def test_auto_and_none_with_plain_text(server):
    """The tiny model writes no <tool_call> by itself: "auto" then answers as "none" does,
    content and no tool_calls."""
    auto = chat(server, tool_choice="auto")
    none = chat(server, tool_choice="none")
    default = chat(server)  # with tools, "auto" is the default
    assert "<tool_call>" not in (auto[0] or ""), auto
    assert auto[1] == [] and auto[2] in ("stop", "length"), auto
    assert auto[:3] == none[:3] == default[:3], (
        "the same greedy text must come back whatever tool_choice says when it holds no call"
    )


# --- refusals ---------------------------------------------------------------------------------

BAD_TOOL = {"type": "function", "function": {"name": "f"}}
BAD = [
    # (fields, param, words)
    ({"tools": [{"type": "function"}]}, "tools[0].function", ["required"]),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", ["function"]),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", ["pattern"]),
    ({"tools": [BAD_TOOL, BAD_TOOL]}, "tools[1].function.name", ["unique"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", ["JSON object"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters", ["object"]),
    ({"tools": [BAD_TOOL, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]},
     "tools[1].function.parameters", ["uniqueItems"]),
    ({"tools": [BAD_TOOL], "tool_choice": "sometimes"}, "tool_choice", ["required"]),
    ({"tools": [BAD_TOOL], "tool_choice": named("g")}, "tool_choice", ["'g'", "f"]),
    ({"tools": [BAD_TOOL], "tool_choice": {"type": "function", "function": {"name": "f",
                                                                           "x": 1}}},
     "tool_choice", ["name"]),
    ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"tools": [BAD_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", ["tool_choice"]),
    ({"tools": [BAD_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", ["bool"]),
    ({"functions": [{"name": "f"}]}, "functions", ["tools"]),
    ({"messages": [*QUESTION, {"role": "tool", "content": "42"}]}, "messages[1]",
     ["tool_call_id"]),
    ({"messages": [{"role": "user", "content": "Hi", "tool_call_id": "x"}]}, "messages[0]",
     ["tool_call_id"]),
    ({"messages": [{"role": "user", "content": "Hi", "tool_calls": []}]}, "messages[0]",
     ["assistant"]),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": {"x": 1}}}]}]},
     "messages[1].tool_calls[0].function.arguments", ["string"]),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, words", BAD, ids=[f"{b[1]}-{i}" for i, b in
                                                           enumerate(BAD)])  # fmt: skip
def test_bad_tool_inputs_are_400s_naming_the_field(server, fields, param, words):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, **fields}
    before = {c: server.metrics()[c] for c in COUNTERS}
    status, _, raw = request(server.port, "POST", CHAT, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, f"{status}, param {error['param']!r}: {raw}"
    for word in words:
        assert word in error["message"], f"{word!r} not in {error['message']!r}"
    assert {c: server.metrics()[c] for c in COUNTERS} == before, (
        "a refused request must not reach the engine"
    )


def test_tool_grammars_are_compiled_once(tokenizer):
    grammars = Grammars(TokenTexts(tokenizer))
    tools = [Tool(**t) for t in TOOLS]

    async def run():
        for choice in ["required", named("add"), "required", named("add"), "auto"]:
            plan = await plan_tools(tools, choice, grammars)
            assert (plan.grammar is None) == (choice == "auto")

    asyncio.run(run())
    assert grammars.compiled == len(TOOLS) + 2, (
        f"{grammars.compiled} compilations: one per function's schema and one per (tools, "
        "choice) grammar, each cached"
    )


# --- without a server: the parser and the rendering --------------------------------------------

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
PARSED = [
    # (text, content, [(name, arguments)])
    ("Hello there.", "Hello there.", []),
    (CALL, None, [("add", '{"a": 1, "b": 2}')]),
    (f"Let me add.\n{CALL}\n", "Let me add.", [("add", '{"a": 1, "b": 2}')]),
    (f"{CALL}\n{CALL}", None, [("add", '{"a": 1, "b": 2}')] * 2),
    (f"a {CALL} b", "ab", [("add", '{"a": 1, "b": 2}')]),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ("<tool_call>not json</tool_call> x", "<tool_call>not json</tool_call> x", []),
    ("x <tool_call>\n{\"name\": \"add\"", "x<tool_call>\n{\"name\": \"add\"", []),
    ("ends with <tool", "ends with <tool", []),
    ("a < b <to c", "a < b <to c", []),
    ("trailing space \n", "trailing space \n", []),
]  # fmt: skip


@pytest.mark.parametrize("text, content, calls", PARSED)
def test_parser_whole_and_in_every_split(text, content, calls):
    got_content, got_calls = ToolCallParser(["add"]).parse(text)
    pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]
    assert (got_content, pairs) == (content, calls)
    assert [c["index"] for c in got_calls] == list(range(len(calls)))
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser, sent, streamed = ToolCallParser(["add"]), "", []
        for i, piece in enumerate(pieces):
            part, new = parser.feed(piece)
            sent += part + (parser.finish() if i == len(pieces) - 1 else "")
            streamed += new
        assert sent == (content or "") and len(streamed) == len(calls), (
            f"split {pieces[:2]}...: content {sent!r}, {len(streamed)} calls: a stream must "
            "join to the whole answer (hold back what may begin <tool_call>)"
        )


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 1 and 2."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add",
                                                      "arguments": '{"a": 1, "b": 2}'}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "3"},
    {"role": "tool", "tool_call_id": "c2", "content": "error"},
]  # fmt: skip
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": ADD}}
QWEN3_TEXT = (  # Qwen3's chat template's rendering of CONVERSATION with ADD_TOOL
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>\n" + json.dumps(ADD_TOOL) + "\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML "
    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n<|im_start|>user\nAdd 1 and 2.<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "add", "arguments": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
    "<tool_response>\n3\n</tool_response>\n<tool_response>\nerror\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def test_a_template_without_tools_gets_qwen3s_format(tokenizer):
    assert "tools" not in tokenizer.chat_template, "the shipped tiny model's template changed"
    assert render_with_tools(tokenizer, CONVERSATION, [ADD_TOOL]) == QWEN3_TEXT, (
        "the fallback must render tools, calls and results as Qwen3's template does"
    )


def test_a_template_with_tools_gets_them_as_they_are(tokenizer):
    template = ("{{ tools | tojson }}{% for m in messages %}|{{ m.role }}:"
                "{{ m.tool_calls | tojson if m.tool_calls else m.content }}{% endfor %}")  # fmt: skip
    own = Tokenizer(tokenizer.hf_tokenizer, tokenizer.config, chat_template=template)
    text = render_with_tools(own, CONVERSATION, [ADD_TOOL])
    assert text.startswith(json.dumps([ADD_TOOL])), text[:200]
    assert json.dumps(CONVERSATION[2]["tool_calls"]) in text and "|tool:3|tool:error" in text


# --- the agent ----------------------------------------------------------------------------------


def test_calculator_is_arithmetic_only():
    assert calculate("12 * (3 + 4)") == 84 and calculate("2 ** 10 / 4 - -1") == 257
    assert calculator("7 / 2") == "3.5" and calculator("6 * 7.0") == "42"
    for bad, why in [("__import__('os')", "Call"), ("1 / 0", "zero"), ("9 ** 99", "exponent"),
                     ("10 ** 40", "too large"), ("(-8) ** 0.5", "real"), ("2 +", "expression"),
                     ("x", "Name"), ("1" * 80, "longer")]:  # fmt: skip
        assert calculator(bad).startswith("error:") and why in calculator(bad), (bad, why)


def agent(tmp_path, *flags, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tiny_llm_support.agent", *flags],
        cwd=ROOT, env=offline_env(tmp_path), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def check_agent_run(result: subprocess.CompletedProcess) -> None:
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "turn 1 (tool_choice required)" in out and "  call " in out and "    -> " in out, (
        f"the first turn must make a tool call and print its result:\n{out}"
    )
    assert "\nanswer: " in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("status: answered after") and "0 tool calls" not in last, last


def test_agent_against_a_served_model(server, tmp_path):
    url = f"http://127.0.0.1:{server.port}/v1"
    check_agent_run(agent(tmp_path, "--url", url, "--question", "What is 6 * 7?"))


def test_agent_starts_its_own_server(tmp_path):
    check_agent_run(agent(tmp_path, "--max-turns", "2"))


def test_agent_ctrl_c_ends_quietly(server, tmp_path):
    """Ctrl-C while the agent waits for the server (stopped with SIGSTOP, so that the wait
    lasts): `interrupted` and status 130, no traceback; the server serves on."""
    url = f"http://127.0.0.1:{server.port}/v1"
    server.proc.send_signal(signal.SIGSTOP)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiny_llm_support.agent", "--url", url],
            cwd=ROOT, env=offline_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert proc.stdout.readline().startswith("question:")
        assert proc.stdout.readline().startswith("turn 1")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert proc.returncode == 130, out + err
    assert err.strip().splitlines() == ["interrupted"], f"not quiet: {err}"
    wait_until(lambda: request(server.port, "GET", "/health")[0] == 200, 10, "the server serves")

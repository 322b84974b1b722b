"""serve.py (Week 4 Day 8) under LangChain, unchanged: `langchain_openai.ChatOpenAI` (invoke,
stream, logprobs, `bind_tools`, `with_structured_output` by json_schema and by function calling,
a tool's result sent back as a ToolMessage) and its completions class `OpenAI` (a prompt list,
stream, batch, logprobs and echo). LangChain builds every request itself, so these tests check
that what a popular client sends is accepted and what the server answers parses there.

The server is started as test_serve_tools.py starts its own (the shipped tiny chat model, its
flags: a context long enough for the tools' system message). Every schema is bounded (string
lengths, enums, integer ranges, no extra keys): a call enforced by a grammar must let the tiny
random model finish. LangChain keeps `additionalProperties: false` of a pydantic model with
extra="forbid"; a @tool's schema keeps it only with bind_tools(strict=True).

Offline: tiktoken's encodings are never downloaded. Nothing here counts tokens on the client
side (LangChain only does for get_num_tokens and for OpenAI(max_tokens=-1)); an empty
TIKTOKEN_CACHE_DIR and a tiktoken whose download raises make any such call fail loudly.
"""

import json
from typing import Literal

import langchain_openai
import pytest
import tiktoken.load
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field
from test_serve import MODEL, Server
from test_serve_tools import FLAGS

from tiny_llm_support import resolve_model
from tiny_llm_support.chat_format import render_with_tools
from tiny_llm_support.server_tools import Tool
from tiny_llm_support.tokenizer import load_tokenizer

QUESTION = "What is a KV cache?"
MAX_TOKENS = 40  # a text answer: enough to see it, short enough to be quick
CALL_TOKENS = 120  # an enforced call ends with its grammar, well within this


class GetWeather(BaseModel):
    """Weather in a city."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties false: the call ends
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class Person(BaseModel):
    """A person."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]


@tool
def add(a: int = Field(ge=-99, le=99), b: int = Field(ge=-99, le=99)) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No tiktoken download (an empty cache, a download that raises) and no LangSmith
    tracing, for every test here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken-cache")))

        def no_download(blobpath: str) -> bytes:
            raise AssertionError(
                f"tiktoken tried to download {blobpath}: something counted tokens on the client "
                "(get_num_tokens, or OpenAI(max_tokens=-1)); these tests must not"
            )

        mp.setattr(tiktoken.load, "read_file", no_download)
        mp.setenv("LANGSMITH_TRACING", "false")
        mp.setenv("LANGCHAIN_TRACING_V2", "false")
        yield


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-langchain"), *FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(MODEL))


def chat_model(server, **fields) -> langchain_openai.ChatOpenAI:
    fields = {"temperature": 0, "max_tokens": MAX_TOKENS, **fields}
    return langchain_openai.ChatOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", model=MODEL,
        max_retries=0, timeout=60, **fields,
    )  # fmt: skip


def completions_model(server, **fields) -> langchain_openai.OpenAI:
    fields = {"temperature": 0, "max_tokens": 10, **fields}
    return langchain_openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", model=MODEL,
        max_retries=0, timeout=60, **fields,
    )  # fmt: skip


def joined(chunks: list) -> AIMessage:
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    return whole


# --- ChatOpenAI: text --------------------------------------------------------------------------


def test_chat_invoke_and_stream(server):
    """invoke: text, finish_reason, usage; stream (with stream_options.include_usage, as
    stream_usage=True asks): the same greedy text, the usage on a chunk, the finish_reason."""
    answer = chat_model(server).invoke(QUESTION)
    assert isinstance(answer.content, str) and answer.content, (
        f"no text in {answer!r} (is choices[0].message.content a string?)"
    )
    assert answer.response_metadata["finish_reason"] in ("stop", "length"), answer.response_metadata
    usage = answer.usage_metadata
    assert usage and usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= MAX_TOKENS, (
        f"usage {usage}: is `usage` sent, and is max_completion_tokens (what LangChain sends "
        "for max_tokens) honored?"
    )

    chunks = list(chat_model(server, stream_usage=True).stream(QUESTION))
    streamed = joined(chunks)
    assert streamed.content == answer.content, (
        f"streamed {streamed.content!r} != whole {answer.content!r} (do the chunks' deltas join "
        "to the whole answer?)"
    )
    assert (
        streamed.response_metadata.get("finish_reason") == answer.response_metadata["finish_reason"]
    ), f"stream's finish_reason: {streamed.response_metadata}"
    counts = ("input_tokens", "output_tokens", "total_tokens")
    got = {k: (streamed.usage_metadata or {}).get(k) for k in counts}
    assert got == {k: usage[k] for k in counts}, (  # cached tokens differ: the prefix cache
        f"stream usage {streamed.usage_metadata} != {usage} (stream_options.include_usage: one "
        "last chunk with empty choices and the usage)"
    )


def test_chat_logprobs(server):
    """logprobs=True, top_logprobs=2: OpenAI's logprobs.content, one entry per token, whose
    tokens join to the text."""
    answer = chat_model(server, logprobs=True, top_logprobs=2, max_tokens=8).invoke("Hi")
    content = (answer.response_metadata.get("logprobs") or {}).get("content")
    assert content, f"no logprobs.content in {answer.response_metadata}"
    assert "".join(entry["token"] for entry in content) == answer.content, (
        "the logprobs' tokens must join to the text"
    )
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2, entry


# --- ChatOpenAI: tools ---------------------------------------------------------------------------


def test_bind_tools_named_whole_and_streamed(server):
    """bind_tools([a pydantic model], tool_choice=its name): one call whose args the model
    validates, no text; streamed, the tool_call_chunks join to the same call."""
    bound = chat_model(server, max_tokens=CALL_TOKENS).bind_tools(
        [GetWeather], tool_choice="GetWeather"
    )
    message = "What is the weather in Paris?"
    answer = bound.invoke(message)
    assert answer.response_metadata["finish_reason"] == "tool_calls", (
        f"finish {answer.response_metadata['finish_reason']!r}, content {answer.content!r}, "
        f"invalid calls {answer.invalid_tool_calls} (is the named function enforced, and parsed "
        "into message.tool_calls?)"
    )
    assert len(answer.tool_calls) == 1 and not answer.invalid_tool_calls, answer
    (call,) = answer.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("call_"), call
    GetWeather.model_validate(call["args"])  # the arguments fit the schema LangChain sent
    assert answer.content == "", f"content {answer.content!r} beside the call (null expected)"

    streamed = joined(list(bound.stream(message)))
    pairs = [(c["name"], c["args"]) for c in streamed.tool_calls]
    assert pairs == [(call["name"], call["args"])] and not streamed.invalid_tool_calls, (
        f"streamed calls {streamed.tool_calls}, invalid {streamed.invalid_tool_calls} != whole "
        f"{answer.tool_calls} (each call once in a delta with its index, id, name and arguments)"
    )
    assert streamed.tool_calls[0]["id"].startswith("call_"), streamed.tool_calls
    assert streamed.response_metadata.get("finish_reason") == "tool_calls", (
        streamed.response_metadata
    )


def test_bind_tools_any_with_a_strict_tool(server):
    """A @tool function, strict=True (LangChain adds additionalProperties false and sends
    "strict": true), tool_choice "any" (sent as "required")."""
    bound = chat_model(server, max_tokens=CALL_TOKENS).bind_tools(
        [add, GetWeather], tool_choice="any", strict=True
    )
    answer = bound.invoke("What is 2 + 3?")
    assert len(answer.tool_calls) == 1 and not answer.invalid_tool_calls, (
        f"calls {answer.tool_calls}, invalid {answer.invalid_tool_calls}, content "
        f"{answer.content!r} (tool_choice 'required' must be enforced; is function.strict "
        "accepted?)"
    )
    (call,) = answer.tool_calls
    schema = add.tool_call_schema if call["name"] == "add" else GetWeather
    schema.model_validate(call["args"])


def test_tool_round_trip(server, tokenizer):
    """The call, its result as a ToolMessage, and an answer in text: the server renders the
    assistant's tool_calls (null content) and the tool message, and answers them."""
    tools = [add]
    llm = chat_model(server, max_tokens=CALL_TOKENS)
    messages = [HumanMessage("What is 2 + 3?")]
    first = llm.bind_tools(tools, tool_choice="add", strict=True).invoke(messages)
    assert len(first.tool_calls) == 1, f"no call to send back: {first!r}"
    (call,) = first.tool_calls
    result = add.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"], result
    messages += [first, result]

    answer = chat_model(server).bind_tools(tools, strict=True).invoke(messages)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls, (
        f"{answer!r}: the tiny model answers a tool's result in text (tool_choice auto)"
    )
    assert answer.response_metadata["finish_reason"] in ("stop", "length"), answer
    sent = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": "add", "arguments": json.dumps(call["args"])}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": result.content},
    ]  # fmt: skip
    tool_dicts = [Tool(**convert_to_openai_tool(t, strict=True)).model_dump(exclude_none=True)
                  for t in tools]  # fmt: skip
    expected = render_with_tools(tokenizer, sent, tool_dicts)
    assert f"<tool_response>\n{result.content}\n</tool_response>" in expected
    assert answer.usage_metadata["input_tokens"] == len(tokenizer.encode(expected)), (
        "the prompt is not the conversation LangChain sent, rendered by chat_format (the "
        "assistant's tool_calls and the tool message's result in Qwen3's format)"
    )


# --- ChatOpenAI: structured output ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(server, method):
    """with_structured_output(Person): a parsed instance, by response_format json_schema
    (strict) or by a call to a function named after the model (tool_choice named)."""
    strict = {"strict": True} if method == "json_schema" else {}
    structured = chat_model(server, max_tokens=CALL_TOKENS).with_structured_output(
        Person, method=method, include_raw=True, **strict
    )
    out = structured.invoke("Describe a person.")
    raw = out["raw"]
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person), (
        f"{method}: parsed {out['parsed']!r}, error {out['parsing_error']!r}, content "
        f"{raw.content!r}, calls {raw.tool_calls}, finish {raw.response_metadata.get('finish_reason')!r} "
        "(is the schema enforced by a grammar, and for function_calling, the call parsed into "
        "tool_calls?)"
    )
    if method == "json_schema":
        assert Person.model_validate_json(raw.content) == out["parsed"]


# --- OpenAI (completions) -------------------------------------------------------------------------


def test_completions_invoke_stream_batch(server):
    """invoke (LangChain sends `prompt` as a list of one), stream (a string prompt), and batch
    (two prompts in one list, the choices by index): the same greedy texts."""
    llm = completions_model(server)
    text = llm.invoke("The KV cache")
    assert isinstance(text, str) and text, f"{text!r} (choices[0].text of a prompt list)"
    streamed = "".join(llm.stream("The KV cache"))
    assert streamed == text, f"streamed {streamed!r} != whole {text!r}"
    batch = llm.batch(["The KV cache", "Paged attention"])
    assert batch[0] == text and isinstance(batch[1], str) and batch[1], (
        f"batch {batch}: one choice per prompt of the list, in order (choices[i].index)"
    )
    alone = llm.invoke("Paged attention")
    assert batch[1] == alone, f"the second prompt of a list {batch[1]!r}, alone {alone!r}"


def test_completions_logprobs_and_echo(server):
    """OpenAI(logprobs=2): the legacy logprobs (tokens, token_logprobs, top_logprobs,
    text_offset) in generation_info; with echo (model_kwargs) the prompt comes back first, its
    first token without a logprob."""
    prompt = "The KV cache"
    result = completions_model(server, logprobs=2).generate([prompt])
    generation = result.generations[0][0]
    logprobs = generation.generation_info["logprobs"]
    assert logprobs and "".join(logprobs["tokens"]) == generation.text, (
        f"logprobs {logprobs} must cover the text {generation.text!r}"
    )
    n = len(logprobs["tokens"])
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == n, logprobs
    assert all(len(top) >= 2 for top in logprobs["top_logprobs"]), logprobs["top_logprobs"]

    echoed = completions_model(server, logprobs=1, max_tokens=3, model_kwargs={"echo": True})
    generation = echoed.generate([prompt]).generations[0][0]
    logprobs = generation.generation_info["logprobs"]
    assert generation.text.startswith(prompt), f"echo: {generation.text!r} starts not with it"
    assert "".join(logprobs["tokens"]) == generation.text, logprobs
    assert logprobs["token_logprobs"][0] is None and logprobs["text_offset"][0] == 0, (
        f"echo: the prompt's first token has no logprob: {logprobs}"
    )

"""serve.py's agents' features (Week 4 Day 8) as a client sees them: logprobs on both endpoints
in OpenAI's wire format, completions' echo (prompt logprobs, and max_tokens 0 for the prompt
alone, as lm-evaluation-harness asks), and response_format (JSON, and JSON fitting a schema).

Support code like tests/test_serve.py, whose server (the shipped tiny chat model, the reference
package, four decode slots over a paged pool) and Reference are used here. The outside oracles:
mlx-lm's Qwen3 on the same weights for every logprob (a log-softmax of its logits, computed
here), and `jsonschema` for every structured answer.
"""

import asyncio
import concurrent.futures
import json

import jsonschema
import mlx.core as mx
import numpy as np
import openai
import pytest
from oracles import mlx_lm_greedy, mlx_lm_logits
from test_serve import ENGINE_FLAGS, MODEL, PAGED_FLAGS, Reference, Server, request

from tiny_llm_support.server_formats import Grammars, ResponseFormat, SchemaError, TokenTexts

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TOL = 1e-4
QUESTION = "What is a KV cache?"

# every string, array and number bounded: a tiny model under a grammar must still finish
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            # multipleOf bounds the digits (0.25 is exact in binary, for jsonschema's check)
            "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """test_serve's main server: four decode slots, a bounded paged pool, the prefix cache."""
    s = Server(tmp_path_factory.mktemp("serve-agents"), *ENGINE_FLAGS, *PAGED_FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref():
    return Reference()


def json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


# --- the oracle -----------------------------------------------------------------------------------


def oracle_logprobs(ref, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: row i, the log-softmax of mlx-lm's logits after ids[: i + 1]."""
    logits = mlx_lm_logits(ref.ckpt, mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def check_top(row: np.ndarray, top: list[tuple[str, float]], k: int, text_of, what: str) -> None:
    """The server's top entries (text, logprob) of one place against the oracle's row: k of
    them, sorted descending, each the logprob of a token with that text."""
    values = [v for _, v in top]
    assert len(top) == k, f"{what}: {len(top)} top entries for top_logprobs {k}"
    assert values == sorted(values, reverse=True), f"{what}: top_logprobs not sorted: {values}"
    best = np.argsort(-row)[: k + 2]
    expected = np.sort(row)[::-1][:k]
    assert np.allclose(values, expected, atol=TOL), (
        f"{what}: top logprobs {values} != the oracle's {expected.tolist()} (the top k of the "
        "row's log-softmax, raw logits, before temperature)"
    )
    for text, value in top:
        assert any(text_of(t) == text and abs(row[t] - value) < TOL for t in best), (
            f"{what}: top entry {text!r} {value} is not one of the oracle's most likely tokens"
        )


# --- logprobs -----------------------------------------------------------------------------------


def chat_logprobs(server, stream: bool, k: int = 3, max_tokens: int = 10) -> tuple[str, list]:
    """(text, logprobs.content) of a greedy chat answer, whole or streamed (joined)."""
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=max_tokens,
        logprobs=True,
        top_logprobs=k,
        stream=stream,
    )
    if not stream:
        return r.choices[0].message.content, r.choices[0].logprobs.content
    text, content = "", []
    for chunk in r:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            content += choice.logprobs.content if choice.logprobs else []
    return text, content


def test_chat_logprobs_equal_the_models(server, ref):
    k, n = 3, 10
    text, content = chat_logprobs(server, stream=False, k=k, max_tokens=n)
    assert len(content) == n, f"{len(content)} logprob entries for {n} tokens generated"
    prompt = ref.chat_ids(QUESTION)
    generated = mlx_lm_greedy(ref.ckpt, prompt, n)
    rows = oracle_logprobs(ref, prompt + generated)[len(prompt) - 1 :]
    text_of = lambda t: ref.tokenizer.decode([t])
    assert [e.token for e in content] == [text_of(t) for t in generated], (
        "the tokens of logprobs.content are not the greedy tokens (each one's own decode)"
    )
    assert b"".join(bytes(e.bytes) for e in content) == text.encode(), (
        "the `bytes` of the entries, joined, must be the answer's UTF-8 (each token's own bytes)"
    )
    for i, (entry, token) in enumerate(zip(content, generated)):
        what = f"token {i} ({entry.token!r})"
        assert abs(entry.logprob - rows[i][token]) < TOL, (
            f"{what}: logprob {entry.logprob} != the oracle's {rows[i][token]} (log-softmax of "
            "the raw logits at that place)"
        )
        top = [(t.token, t.logprob) for t in entry.top_logprobs]
        check_top(rows[i], top, k, text_of, what)
        assert entry.token in [t for t, _ in top], f"{what}: the greedy token is not in its top"
        for t in entry.top_logprobs:
            if "\ufffd" not in t.token:  # a whole character: its bytes are its text's
                assert bytes(t.bytes) == t.token.encode(), f"{what}: top entry {t.token!r} bytes"


def test_streamed_logprobs_equal_whole_ones(server):
    whole_text, whole = chat_logprobs(server, stream=False)
    streamed_text, streamed = chat_logprobs(server, stream=True)
    assert streamed_text == whole_text
    assert [e.token for e in streamed] == [e.token for e in whole], (
        "a stream must carry each token's entry once, in the chunk of its text"
    )
    for a, b in zip(streamed, whole):
        assert abs(a.logprob - b.logprob) < TOL and len(a.top_logprobs) == len(b.top_logprobs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_with_echo(server, ref, stream):
    prompt, k, n = "The river keeper said", 2, 6
    ids = ref.tokenizer.encode(prompt)
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=n, logprobs=k, echo=True)
    kwargs["extra_body"] = {"ignore_eos": True}
    if not stream:
        r = server.client().completions.create(**kwargs)
        text, lp, usage = r.choices[0].text, r.choices[0].logprobs, r.usage
        columns = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    else:
        chunks = list(
            server.client().completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
        )
        text, usage = "".join(c.choices[0].text for c in chunks[:-1]), chunks[-1].usage
        parts = [c.choices[0].logprobs for c in chunks[:-1] if c.choices[0].logprobs]
        columns = [sum((getattr(p, name) for p in parts), []) for name in
                   ("tokens", "token_logprobs", "top_logprobs", "text_offset")]  # fmt: skip
    tokens, values, tops, offsets = columns
    generated = mlx_lm_greedy(ref.ckpt, ids, n)
    every = ids + generated
    text_of = lambda t: ref.tokenizer.decode([t])
    assert text == prompt + ref.tokenizer.decode(generated), "echo: the prompt, then the answer"
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), n)
    assert tokens == [text_of(t) for t in every], "echo's logprobs: the prompt's tokens first"
    assert values[0] is None and tops[0] is None, "nothing predicts the prompt's first token"
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))], (
        "text_offset: where each token's text starts in the choice's text"
    )
    rows = oracle_logprobs(ref, every)
    for i in range(1, len(every)):
        what = f"{'prompt' if i < len(ids) else 'answer'} token {i} ({tokens[i]!r})"
        assert abs(values[i] - rows[i - 1][every[i]]) < TOL, (
            f"{what}: logprob {values[i]} != the oracle's {rows[i - 1][every[i]]}"
            + (" (Engine.score's prompt logprobs)" if i < len(ids) else "")
        )
        assert tokens[i] in tops[i] and len(tops[i]) <= k + 1, (
            f"{what}: top_logprobs {tops[i]} must hold the top {k} and the chosen token"
        )
        check_top(rows[i - 1], sorted(tops[i].items(), key=lambda kv: -kv[1])[:k], k, text_of, what)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, ref):
    """lm-evaluation-harness's loglikelihood request: the prompts scored, nothing generated."""
    prompts = ["Once upon a time", "The cat sat"]
    counters = ["tiny_llm_prompt_tokens_prefilled_total", "tiny_llm_requests_finished_total"]
    before = {c: server.metrics()[c] for c in counters}
    r = server.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert {c: server.metrics()[c] for c in counters} == before, (
        "max_tokens 0 must not generate: no engine request, no prefill (a score only)"
    )
    lengths = [len(ref.tokenizer.encode(p)) for p in prompts]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(lengths), 0)
    for choice, prompt in zip(r.choices, prompts):
        assert (choice.text, choice.finish_reason) == (prompt, "length")
        ids = ref.tokenizer.encode(prompt)
        rows = oracle_logprobs(ref, ids)
        values = choice.logprobs.token_logprobs
        assert values[0] is None and len(values) == len(ids)
        assert np.allclose(values[1:], [rows[i - 1][ids[i]] for i in range(1, len(ids))], atol=TOL)
    streamed = list(
        server.client().completions.create(
            model=MODEL, prompt=prompts[0], max_tokens=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == prompts[0]
    assert streamed[-1].choices[0].finish_reason == "length"


# --- response_format ---------------------------------------------------------------------------


def ask(server, response_format=None, seed=None, stream=False, question=QUESTION):
    """(text, finish_reason) of a chat answer, greedy or seeded."""
    sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=120,
        response_format=response_format or openai.NOT_GIVEN,
        stream=stream,
        **sampling,
    )
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].choices[0].finish_reason
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_json_schema_answers_validate_batched_with_free_text(server):
    """Every schema under greedy and seeded sampling, all at once (the server's four slots
    mix constrained rows with free ones), one streamed: each answer parses and validates."""
    jobs = [(name, seed, False) for name in SCHEMAS for seed in (None, 3)]
    jobs += [("numbers", 11, True), ("nested", None, True)]
    free = [(None, None, False), (None, 5, False)]
    # json_object: any JSON object, greedy; its keys are free strings, which the tiny model
    # rarely closes, so only the answers that finish are parsed
    questions = ["What is stream_options?", "Who are you?", "Describe a cat as JSON."]
    json_object = {"type": "json_object"}
    with concurrent.futures.ThreadPoolExecutor(len(jobs + free + questions)) as pool:
        runs = [
            pool.submit(ask, server, name and json_schema(name), seed, stream)
            for name, seed, stream in jobs + free
        ]
        runs += [pool.submit(ask, server, json_object, question=q) for q in questions]
        answers = [run.result() for run in runs]
    for (name, seed, stream), (text, finish) in zip(jobs, answers):
        what = f"schema {name!r}, {'greedy' if seed is None else f'seed {seed}'}"
        what += ", streamed" if stream else ""
        assert finish == "stop", f"{what}: finished with {finish!r}, text {text!r}"
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(
                f"{what}: {text!r} does not fit its schema (is the grammar's mask applied "
                f"to this request's row only, and before sampling?): {e}"
            ) from None
    for (_, seed, _), (text, _) in zip(free, answers[len(jobs) :]):
        assert not text.startswith("{"), f"a free request (seed {seed}) was constrained: {text!r}"
    closed = 0
    for question, (text, finish) in zip(questions, answers[len(jobs) + len(free) :]):
        assert text.startswith('{"') or text.startswith("{}"), f"json_object: {text!r}"
        if finish == "stop":
            closed += 1
            assert isinstance(json.loads(text), dict), f"json_object, {question!r}: {text!r}"
    assert closed, (
        "no json_object answer closed its object within max_tokens (the shipped tiny model "
        "closes '{}' for 'What is stream_options?' greedily; a retrained one may need another "
        "question)"
    )


def test_json_schema_answers_with_speculation_on(server, tmp_path):
    """serve --speculative ngram: guesses the grammar forbids are dropped and each checked row
    is masked as the grammar stands after the guesses before it, so every answer still fits
    its schema, and a greedy one is the plain server's, token for token."""
    flags = (*ENGINE_FLAGS, *PAGED_FLAGS, "--speculative", "ngram", "--num-draft-tokens", "4")
    speculating = Server(tmp_path, *flags)
    try:
        with concurrent.futures.ThreadPoolExecutor(2 * len(SCHEMAS)) as pool:
            runs = {
                (name, seed): pool.submit(ask, speculating, json_schema(name), seed)
                for name in SCHEMAS
                for seed in (None, 7)
            }
            answers = {job: run.result() for job, run in runs.items()}
        metrics = speculating.metrics()
    finally:
        speculating.stop()
    for (name, seed), (text, finish) in answers.items():
        what = f"with speculation, schema {name!r}, {'greedy' if seed is None else f'seed {seed}'}"
        assert finish == "stop", f"{what}: finished with {finish!r}, text {text!r}"
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(
                f"{what}: {text!r} does not fit its schema: a guess the grammar forbids was "
                f"kept, or a checked row was masked as the grammar stood before the pass: {e}"
            ) from None
        if seed is None:
            plain = ask(server, json_schema(name))
            assert (text, finish) == plain, (
                f"{what}: {text!r}, without speculation {plain[0]!r}: speculation must never "
                "change a greedy answer, under a grammar too"
            )
    assert metrics.get("tiny_llm_spec_tokens_accepted_total", 0) > 0, (
        "no guess was kept under a grammar: the speculating server never sped anything up (setup)"
    )


def test_forbidden_tokens_go_on_the_wire_as_minus_9999(server):
    """Under a grammar the first token can only be '{': every other token's logprob is -inf,
    which JSON cannot carry."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
            "response_format": json_schema("enum")}  # fmt: skip
    status, _, raw = request(server.port, "POST", CHAT, body)
    assert status == 200 and b"Infinity" not in raw and b"NaN" not in raw, raw[:300]
    first = json.loads(raw)["choices"][0]["logprobs"]["content"][0]
    assert (first["token"], first["logprob"]) == ("{", 0.0), first
    assert [t["logprob"] for t in first["top_logprobs"]] == [0.0, -9999.0, -9999.0], (
        "a token the grammar forbids has logprob -inf, sent as -9999.0"
    )


def test_schemas_are_compiled_once(ref):
    grammars = Grammars(TokenTexts(ref.tokenizer))
    schema = SCHEMAS["nested"]
    reordered = {key: schema[key] for key in reversed(schema)}

    async def run():
        fmt = lambda s: ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
        )
        first = await grammars.grammar(fmt(schema))
        assert await grammars.grammar(fmt(json.loads(json.dumps(schema)))) == first
        await grammars.grammar(fmt(reordered))
        assert await grammars.grammar(ResponseFormat(type="text")) is None
        for _ in range(2):
            with pytest.raises(SchemaError, match="uniqueItems"):
                await grammars.grammar(fmt({"type": "array", "uniqueItems": True}))

    asyncio.run(run())
    assert grammars.compiled == 3, (
        f"{grammars.compiled} compilations: one per distinct schema (key order counts: it is "
        "the order of the answer's keys), a refused one remembered too"
    )


# --- refusals -----------------------------------------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]
BAD = [
    # (endpoint, fields, the param and words the error must name)
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "bogus"}}}}, "response_format", ["bogus"]),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", ["uniqueItems"]),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "[a-z"}}}}, "response_format", ["regex"]),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [
        1]}}}, "response_format.json_schema.schema", ["JSON object"]),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", ["json_schema"]),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type", ["type"]),
    (TEXT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 2}}}}, "response_format", ["minimum"]),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["20"]),
    (CHAT, {"top_logprobs": 2}, "top_logprobs", ["logprobs"]),
    (CHAT, {"logprobs": 1}, "logprobs", ["bool"]),
    (TEXT, {"logprobs": 21}, "logprobs", ["20"]),
    (TEXT, {"top_logprobs": 2}, "top_logprobs", ["logprobs"]),
    (TEXT, {"max_tokens": 0, "logprobs": 2}, "max_tokens", ["echo"]),
    (CHAT, {"echo": True}, "echo", ["echo"]),
]  # fmt: skip


@pytest.mark.parametrize("path, fields, param, words", BAD, ids=[f"{c[2]}-{i}" for i, c in
                                                                 enumerate(BAD)])  # fmt: skip
def test_bad_inputs_are_400s_naming_the_field(server, path, fields, param, words):
    base = {"model": MODEL, "max_tokens": 2, **({"messages": HI} if path == CHAT else
                                                {"prompt": "Hi"})}  # fmt: skip
    before = server.metrics()["tiny_llm_prompt_tokens_prefilled_total"]
    status, _, raw = request(server.port, "POST", path, {**base, **fields})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, f"{status}, param {error['param']!r}: {raw}"
    for word in [param.split(".")[0], *words]:
        assert word in error["message"], f"{word!r} not in {error['message']!r}"
    assert server.metrics()["tiny_llm_prompt_tokens_prefilled_total"] == before, (
        "a refused request must not reach the engine"
    )


def test_the_official_client_sees_400s(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=HI, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "bogus"}}},
        )  # fmt: skip

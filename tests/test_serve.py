"""serve.py, the OpenAI-compatible server of Week 4 Day 3, as a client sees it.

Not a day file: the server is support code, so these tests run the reference package
(`--solution ref`) whatever --impl says. Each server configuration is started once, in a
subprocess on a free port (127.0.0.1), and driven by the official `openai` client and by raw
HTTP. The expected texts come from tiny_llm_ref.Engine in this process, on the same shipped tiny
model and with the same settings, each prompt run alone and greedy.
"""

import concurrent.futures
import http.client
import importlib.util
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from helpers import offline_env

import tiny_llm_ref
from tiny_llm_support import load_checkpoint, resolve_model

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "serve.py"
MODEL = "tiny"
MAX_SEQ_LEN = 256
PAGE_SIZE, MAX_PAGES = 16, 64
BATCH_SIZE = 4
ENGINE_FLAGS = ["--max-seq-len", str(MAX_SEQ_LEN), "--batch-size", str(BATCH_SIZE)]
PAGED_FLAGS = ["--page-size", str(PAGE_SIZE), "--max-pages", str(MAX_PAGES)]
API_KEY = "test-key"
QUESTIONS = [
    "What is a KV cache?",
    "Tell me a short story about a cat.",
    "What is paged attention?",
    "Why is the sky blue?",
    "What does the scheduler do?",
    "Explain continuous batching.",
    "What is RoPE?",
    "Who are you?",
]
SERVING = re.compile(r"serving '.*' at http://127\.0\.0\.1:(\d+)/v1")


# --- the server in a subprocess ---------------------------------------------------------------


class Server:
    """serve.py on a port of its choosing (--port 0), its output in files under tmp."""

    def __init__(self, tmp: Path, *flags: str, solution: str = "ref", **env: str) -> None:
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), "--model", MODEL, "--solution", solution]
                + ["--port", "0", *flags],
                cwd=ROOT,
                env=offline_env(tmp, **env),
                stdout=out,
                stderr=err,
            )
        self.port = self._wait_for_port(timeout=60)
        self._wait_healthy(timeout=30)

    def _wait_for_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = SERVING.search(self.out.read_text())
            if found:
                return int(found[1])
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the server did not start:\n{self.err.read_text()}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if request(self.port, "GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError("the server never answered /health with 200")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0, timeout=60
        )

    def metrics(self) -> dict[str, float]:
        status, _, body = request(self.port, "GET", "/metrics")
        assert status == 200
        rows = [line.split() for line in body.decode().splitlines() if not line.startswith("#")]
        return {name: float(value) for name, value in rows}

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The main server: a bounded paged pool (so the prefix cache is on, serve's default), four
    decode slots, no key."""
    s = Server(tmp_path_factory.mktemp("serve"), *ENGINE_FLAGS, *PAGED_FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """One decode slot, nobody may wait (--max-waiting 0), an API key, and dense caches (serve's
    other KV storage)."""
    flags = ["--batch-size", "1", "--max-waiting", "0", "--api-key", API_KEY, "--dense"]
    s = Server(tmp_path_factory.mktemp("serve-strict"), "--max-seq-len", str(MAX_SEQ_LEN), *flags)
    yield s
    s.stop()


def typed_metrics(server, *typed: tuple[str, str]) -> str:
    """The text of /metrics, checked to declare each (name, kind) with a # TYPE line."""
    text = request(server.port, "GET", "/metrics")[2].decode()
    for name, kind in typed:
        assert re.search(rf"^# TYPE {name} {kind}$", text, re.M), f"no '# TYPE {name} {kind}'"
    return text


def request(port: int, method: str, path: str, body=None, headers=None, timeout: float = 60):
    """(status, headers, body bytes) of one raw HTTP request; a dict body is sent as JSON."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            method, path, body=body, headers={"Content-Type": "application/json"} | (headers or {})
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


# --- what the engine says, in this process ------------------------------------------------------


class Reference:
    """tiny_llm_ref.Engine on the tiny model with the main server's settings."""

    def __init__(self) -> None:
        self.ckpt = load_checkpoint(resolve_model(MODEL), dtype="float32")
        self.tokenizer = self.ckpt.tokenizer
        self.model = tiny_llm_ref.Qwen3Model(self.ckpt, max_seq_len=MAX_SEQ_LEN)
        self.cache: dict = {}

    def chat_ids(self, question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

    def run(self, ids: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> tuple:
        """(text, finish_reason, prompt_tokens, completion_tokens) of one prompt alone."""
        key = (tuple(ids), max_tokens, stop)
        if key not in self.cache:
            pools = self.model.create_kv_pools(PAGE_SIZE, MAX_PAGES, read_in_place=True)
            engine = tiny_llm_ref.Engine(
                self.model, self.tokenizer, MAX_SEQ_LEN, BATCH_SIZE, pools=pools
            )
            params = tiny_llm_ref.SamplingParams(max_tokens=max_tokens, stop=stop)
            engine.add_request(ids, params)
            text, last = "", None
            while engine.has_work:
                for output in engine.step():
                    text, last = text + output.text, output
            self.cache[key] = (text, last.finish_reason, last.prompt_tokens, last.completion_tokens)
        return self.cache[key]


@pytest.fixture(scope="module")
def ref():
    return Reference()


# --- answers equal the engine's ------------------------------------------------------------------


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL
    status, _, body = request(server.port, "GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok", health
    assert health["engine_pid"] != server.proc.pid, "the engine runs in a process of its own"
    status, headers, body = request(server.port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    for name in [
        "tiny_llm_requests_running",
        "tiny_llm_requests_waiting",
        "tiny_llm_kv_pages_in_use",
        "tiny_llm_kv_pages_free",
        "tiny_llm_prompt_tokens_prefilled_total",
        "tiny_llm_tokens_decoded_total",
        "tiny_llm_preemptions_total",
        "tiny_llm_requests_finished_total",
        "tiny_llm_requests_aborted_total",
    ]:
        assert re.search(rf"^# TYPE {name} (gauge|counter)$", text, re.M), name
        assert re.search(rf"^{name} \d+(\.\d+)?$", text, re.M), name
    for method, path, status in [("GET", CHAT, 405), ("POST", "/v1/embeddings", 404)]:
        got, _, raw = request(server.port, method, path)
        assert got == status and path in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_engine(server, ref, stream):
    question, max_tokens = QUESTIONS[0], 40
    text, finish, prompt_n, completion_n = ref.run(ref.chat_ids(question), max_tokens)
    client = server.client()
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=max_tokens,
    )
    if not stream:
        r = client.chat.completions.create(**kwargs)
        got, got_finish, got_usage = (
            r.choices[0].message.content,
            r.choices[0].finish_reason,
            r.usage,
        )
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    else:
        chunks = list(
            client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        got = "".join(deltas)
        got_finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        got_usage = chunks[-1].usage
        assert {c.id for c in chunks} == {chunks[0].id}
    assert got == text and got_finish == finish
    assert (got_usage.prompt_tokens, got_usage.completion_tokens) == (prompt_n, completion_n)
    assert got_usage.total_tokens == prompt_n + completion_n


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_completion_equals_engine(server, ref, stream, as_ids):
    prompt = "The river keeper said"
    ids = ref.tokenizer.encode(prompt)
    text, finish, _, completion_n = ref.run(ids, 24)
    kwargs = dict(model=MODEL, prompt=ids if as_ids else prompt, temperature=0, max_tokens=24)
    if not stream:
        r = server.client().completions.create(**kwargs)
        assert r.object == "text_completion"
        assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), completion_n)
    else:
        chunks = list(server.client().completions.create(**kwargs, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == text
        assert [c.choices[0].finish_reason for c in chunks][-1] == finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_several_prompts_are_several_choices(server, ref, stream):
    """A list of prompts (LangChain batches its completions so) answers each as a choice of its
    own, in order, each equal to its prompt alone; the usage adds them up."""
    prompts = ["The river keeper said", "Once upon a time", "The cat"]
    alone = [ref.run(ref.tokenizer.encode(p), 10) for p in prompts]
    kwargs = dict(model=MODEL, prompt=prompts, temperature=0, max_tokens=10)
    if not stream:
        r = server.client().completions.create(**kwargs)
        got = [(c.index, c.text, c.finish_reason) for c in r.choices]
        usage = r.usage
    else:
        chunks = list(
            server.client().completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
        )
        texts, finish = [""] * 3, [None] * 3
        for c in chunks[:-1]:
            (choice,) = c.choices
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
        got, usage = [(i, texts[i], finish[i]) for i in range(3)], chunks[-1].usage
    assert got == [(i, text, why) for i, (text, why, _, _) in enumerate(alone)], (
        "choice i must answer prompt i, as it is answered alone"
    )
    assert usage.prompt_tokens == sum(a[2] for a in alone)
    assert usage.completion_tokens == sum(a[3] for a in alone)


def test_stop_string_ends_the_answer(server, ref):
    ids = ref.chat_ids(QUESTIONS[0])
    full = ref.run(ids, 40)[0]
    stop = full.split()[3]  # a word from the middle of the greedy answer
    expected = ref.run(ids, 40, (stop,))
    assert expected[:2] == (full[: full.index(stop)], "stop")
    for stream in (False, True):
        r = server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            temperature=0,
            max_tokens=40,
            stop=[stop, "never appears"],
            stream=stream,
        )
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert (text, finish) == expected[:2]


def test_sixteen_concurrent_streams_each_equal_alone(server, ref):
    questions = [f"{q} Answer briefly, please." for q in QUESTIONS] + QUESTIONS
    max_tokens = [8 + 2 * i for i in range(len(questions))]
    expected = [ref.run(ref.chat_ids(q), n)[0] for q, n in zip(questions, max_tokens)]
    client = server.client()

    def one_stream(i: int) -> str:
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": questions[i]}],
            temperature=0,
            max_tokens=max_tokens[i],
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        got = list(pool.map(one_stream, range(len(questions))))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"stream {i} ({questions[i]!r}) differs from the prompt run alone"


# --- clients that leave ----------------------------------------------------------------------------


def raw_post(port: int, path: str, body: dict) -> socket.socket:
    """A request written by hand on a socket that the test can close at any moment."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}


def assert_pool_freed_by_abort(server, aborted_before: float) -> None:
    def freed() -> bool:
        m = server.metrics()
        return (
            m["tiny_llm_requests_aborted_total"] > aborted_before
            and m["tiny_llm_requests_running"] == 0
            and m["tiny_llm_kv_pages_in_use"] == 0
        )

    wait_until(freed, 5, "the request aborted, running 0 and every page free")
    assert server.metrics()["tiny_llm_kv_pages_free"] == MAX_PAGES


def test_hang_up_mid_stream_aborts_the_request(server):
    aborted = server.metrics()["tiny_llm_requests_aborted_total"]
    sock = raw_post(server.port, "/v1/completions", {**LONG, "stream": True, "temperature": 0})
    received = b""
    while b"data: {" not in received:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()  # after the first chunk of about 200
    assert_pool_freed_by_abort(server, aborted)


def test_hang_up_before_a_whole_answer_aborts_the_request(server):
    aborted = server.metrics()["tiny_llm_requests_aborted_total"]
    sock = raw_post(server.port, "/v1/completions", {**LONG, "temperature": 0})
    wait_until(lambda: server.metrics()["tiny_llm_requests_running"] == 1, 10, "it runs")
    sock.close()
    assert_pool_freed_by_abort(server, aborted)


# --- bad input ------------------------------------------------------------------------------------

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
BAD = [
    # (endpoint, body, status, words the message must hold)
    (CHAT, {"model": "gpt-4o", "messages": HI}, 404, ["model", "gpt-4o", MODEL]),
    (TEXT, {"model": "gpt-4o", "prompt": "Hi"}, 404, ["model", "gpt-4o"]),
    (CHAT, {"messages": HI}, 400, ["model", "required"]),
    (CHAT, {"model": MODEL, "messages": HI, "n": 17}, 400, ["n", "16"]),
    (TEXT, {"model": MODEL, "prompt": "Hi", "best_of": 3}, 400, ["best_of", "n = 3"]),
    (TEXT, {"model": MODEL, "prompt": list(range(MAX_SEQ_LEN + 1))}, 400, ["prompt", "context"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a " * 400}]}, 400,
     ["messages", "context", str(MAX_SEQ_LEN)]),
    (TEXT, {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, ["max_tokens"]),
    (CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": 0}, 400,
     ["max_completion_tokens"]),
    (CHAT, {"model": MODEL, "messages": HI, "temperature": -0.5}, 400, ["temperature"]),
    (CHAT, {"model": MODEL, "messages": HI, "temperature": "hot"}, 400, ["temperature"]),
    (TEXT, {"model": MODEL, "prompt": "Hi", "top_p": 0}, 400, ["top_p"]),
    (TEXT, {"model": MODEL, "prompt": "Hi", "top_p": 1.5}, 400, ["top_p"]),
    (TEXT, {"model": MODEL, "prompt": "Hi", "seed": -1}, 400, ["seed"]),
    (TEXT, {"model": MODEL, "prompt": "Hi", "stop": [""]}, 400, ["stop", "empty"]),
    (TEXT, {"model": MODEL, "prompt": "Hi", "stop": 7}, 400, ["stop"]),
    (CHAT, {"model": MODEL, "messages": HI, "tools": [{"type": "function"}]}, 400,
     ["tools[0].function", "required"]),
    (CHAT, {"model": MODEL, "messages": HI, "top_logprobs": 3}, 400, ["top_logprobs", "logprobs"]),
    (CHAT, {"model": MODEL, "messages": HI, "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, 400, ["response_format"]),
    (CHAT, {"model": MODEL, "messages": HI, "presence_penalty": 0.5}, 400, ["presence_penalty"]),
    (CHAT, {"model": MODEL, "messages": HI, "frobnicate": 1}, 400, ["frobnicate"]),
    (CHAT, {"model": MODEL, "messages": []}, 400, ["messages"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, ["messages[0].content", "text"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     ["messages[0].role"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     ["messages[0]", "tool_call_id"]),
    (CHAT, {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}}, 400,
     ["stream_options", "stream"]),
    (TEXT, {"model": MODEL, "prompt": ["Hi"] * 33}, 400, ["prompt", "at most 32 prompts"]),
    (TEXT, {"model": MODEL, "prompt": []}, 400, ["prompt", "empty"]),  # no token ids
    (TEXT, {"model": MODEL, "prompt": ["Hi", [5, 99999]]}, 400, ["prompt[1]", "99999"]),
    (TEXT, {"model": MODEL, "prompt": list(range(MAX_SEQ_LEN))}, 400, ["prompt", "no room"]),
    (TEXT, {"model": MODEL, "prompt": [5, 99999]}, 400, ["prompt", "99999", "vocabulary"]),
    (TEXT, {"model": MODEL, "prompt": ""}, 400, ["prompt", "empty"]),
    (TEXT, b'{"model": "tiny", "prompt": "Hi"', 400, ["JSON"]),
    (TEXT, b"[1, 2]", 400, ["JSON object"]),
    (TEXT, b'{"model": "tiny", "prompt": "' + b"x" * (1 << 20) + b'"}', 413, ["limit"]),
]  # fmt: skip


def bad_id(case) -> str:
    path, body, status, words = case
    return f"{path.rsplit('/', 1)[-1]}-{status}-{words[0]}"


@pytest.mark.parametrize("case", BAD, ids=[bad_id(c) for c in BAD])
def test_bad_input_gets_an_openai_error(server, case):
    path, body, status, words = case
    got_status, _, raw = request(server.port, "POST", path, body)
    assert got_status == status, raw[:300]
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] and isinstance(error["message"], str)
    for word in words:
        assert word in error["message"], f"{word!r} not in {error['message']!r}"


def test_refused_requests_cost_the_engine_nothing(server):
    counters = [
        "tiny_llm_prompt_tokens_prefilled_total",
        "tiny_llm_requests_finished_total",
        "tiny_llm_requests_aborted_total",
        "tiny_llm_requests_waiting",
        "tiny_llm_kv_pages_in_use",
    ]
    before = {k: server.metrics()[k] for k in counters}
    for path, body, status, _ in BAD:
        assert request(server.port, "POST", path, body)[0] == status
    assert {k: server.metrics()[k] for k in counters} == before


def test_openai_client_errors_and_neutral_fields(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.name"):
        client.chat.completions.create(
            model=MODEL, messages=HI, tools=[{"type": "function", "function": {"name": "f g"}}]
        )
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=HI)
    # what some clients always send, with the values that change nothing, is accepted
    r = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=2,
        n=1,
        logprobs=False,
        top_logprobs=0,
        presence_penalty=0,
        frequency_penalty=0,
        tools=[],
        response_format={"type": "text"},
        user="someone",
    )
    assert r.choices[0].finish_reason in ("stop", "length")


# --- admission and keys -------------------------------------------------------------------------


def test_429_past_max_waiting(strict_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {**LONG, "max_tokens": 120}

    def post(_):
        return request(strict_server.port, "POST", TEXT, body, headers)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(post, range(4)))
    statuses = sorted(status for status, _, _ in results)
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    for status, got_headers, raw in results:
        if status == 429:
            assert int(got_headers["retry-after"]) >= 1
            error = json.loads(raw)["error"]
            assert "--max-waiting" in error["message"] and error["code"] == "rate_limit_exceeded"
    assert strict_server.metrics()["tiny_llm_requests_refused_busy_total"] >= 1


def test_api_key(strict_server):
    port = strict_server.port
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, raw = request(port, "POST", TEXT, {"model": MODEL, "prompt": "Hi"}, headers)
        assert status == 401
        assert json.loads(raw)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        strict_server.client("wrong").models.list()
    assert [m.id for m in strict_server.client(API_KEY).models.list()] == [MODEL]
    r = strict_server.client(API_KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert request(port, "GET", "/health")[0] == 200  # /health and /metrics need no key


def test_sigterm_stops_cleanly(strict_server):
    assert strict_server.stop(signal.SIGTERM) == 0
    assert "Traceback" not in strict_server.err.read_text()


# --- Ctrl-C --------------------------------------------------------------------------------------


def test_ctrl_c_ends_open_streams_with_an_error(tmp_path):
    s = Server(tmp_path, "--max-seq-len", str(MAX_SEQ_LEN))
    try:
        sock = raw_post(s.port, TEXT, {**LONG, "stream": True})
        received = b""
        while b"data: {" not in received:
            received += sock.recv(4096)
        s.proc.send_signal(signal.SIGINT)
        sock.settimeout(30)
        while chunk := sock.recv(4096):
            received += chunk
        sock.close()
        events = [json.loads(e) for e in re.findall(r"^data: (\{.*\})$", received.decode(), re.M)]
        assert "error" in events[-1], events[-1]
        assert "shutting down" in events[-1]["error"]["message"]
        assert s.proc.wait(timeout=30) == 130
    finally:
        s.stop(signal.SIGKILL)
    err = s.err.read_text()
    assert "Traceback" not in err and err.rstrip().endswith("interrupted")


# --- the prefix cache (Week 4 Day 4) ---------------------------------------------------------------

STORY = (
    "The lighthouse keeper of Gull Rock kept a logbook of every ship that passed the point, the "
    "weather at dawn and at dusk, and the colour of the sea. In the winter of the long storm she "
    "wrote that the lamp had burned for nine nights without rest, and that the supply boat came "
    "late with oil, bread and a letter from her brother."
)
ENDINGS = [" Who wrote in the logbook?", " What came on the supply boat?", " How long did it burn?"]


@pytest.fixture(scope="module")
def uncached_server(tmp_path_factory):
    """The main server's settings with --no-prefix-cache."""
    s = Server(
        tmp_path_factory.mktemp("serve-uncached"), *ENGINE_FLAGS, *PAGED_FLAGS, "--no-prefix-cache"
    )
    yield s
    s.stop()


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def story_answers(s: Server) -> list[tuple[str, int, int]]:
    """(text, prompt_tokens, cached_tokens) of the story prompts sent one after the other: a
    completion, one the same streamed with include_usage, then chats with the story as their
    system message (whole, then streamed)."""
    client, got = s.client(), []
    for i, ending in enumerate(ENDINGS):
        kwargs = dict(model=MODEL, prompt=STORY + ending, temperature=0, max_tokens=12)
        if i == 1:
            chunks = list(
                client.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
            )
            text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
        else:
            r = client.completions.create(**kwargs)
            text, usage = r.choices[0].text, r.usage
        got.append((text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
    for stream in (False, True):
        kwargs = dict(
            model=MODEL,
            messages=[
                {"role": "system", "content": STORY},
                {"role": "user", "content": ENDINGS[stream].strip()},
            ],
            temperature=0,
            max_tokens=12,
        )
        if stream:
            chunks = list(
                client.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            r = client.chat.completions.create(**kwargs)
            text, usage = r.choices[0].message.content, r.usage
        got.append((text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
    return got


def test_prefix_cache_finds_the_shared_pages_and_answers_the_same(server, uncached_server, ref):
    assert "prefix cache" in server.out.read_text()
    assert "no prefix cache" in uncached_server.out.read_text()
    before = server.metrics()
    got = story_answers(server)
    after = server.metrics()
    first = ref.tokenizer.encode(STORY + ENDINGS[0])
    for i, (_, prompt_n, cached) in enumerate(got):
        if i in (0, len(ENDINGS)):  # the first completion, the first chat: nothing came before
            assert cached == 0, (i, cached)
            continue
        assert 0 < cached < prompt_n and cached % PAGE_SIZE == 0, (i, cached)
        if i < len(ENDINGS):  # the completions: every full page of what they share with the first
            ids = ref.tokenizer.encode(STORY + ENDINGS[i])
            common = min(shared_prefix(first, ids), len(ids) - 1)
            assert cached == common // PAGE_SIZE * PAGE_SIZE, (i, cached, common)
    # the same text, token counts and all, without the cache; and there nothing is found cached
    plain = story_answers(uncached_server)
    assert [(t, n) for t, n, _ in got] == [(t, n) for t, n, _ in plain]
    assert [c for _, _, c in plain] == [0] * len(plain)

    cached = after["tiny_llm_prompt_tokens_cached_total"]
    prefilled = after["tiny_llm_prompt_tokens_prefilled_total"]
    assert cached - before["tiny_llm_prompt_tokens_cached_total"] == sum(c for _, _, c in got)
    assert prefilled - before["tiny_llm_prompt_tokens_prefilled_total"] == sum(
        n - c for _, n, c in got
    )
    rate = after["tiny_llm_prefix_cache_hit_rate"]
    assert 0 < rate < 1 and rate == pytest.approx(cached / (cached + prefilled), abs=1e-6)
    assert after["tiny_llm_kv_pages_in_use"] == 0 and after["tiny_llm_kv_pages_cached"] > 0
    assert after["tiny_llm_kv_pages_free"] == MAX_PAGES  # cached pages count as free
    m = uncached_server.metrics()
    assert m["tiny_llm_prompt_tokens_cached_total"] == 0 and m["tiny_llm_kv_pages_cached"] == 0
    assert m["tiny_llm_prefix_cache_hit_rate"] == 0


def test_prefix_cache_metrics_are_typed(server):
    typed = [
        ("tiny_llm_prompt_tokens_cached_total", "counter"),
        ("tiny_llm_kv_pages_cached", "gauge"),
        ("tiny_llm_prefix_cache_hit_rate", "gauge"),
    ]
    text = typed_metrics(server, *typed)
    for name, _ in typed:
        assert re.search(rf"^{name} \d+(\.\d+)?$", text, re.M), f"{name}: no plain value"


@pytest.fixture(scope="module")
def serve_module():
    """serve.py imported as a module, for its argument parsing."""
    spec = importlib.util.spec_from_file_location("serve_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags, on",
    [
        ([], True),  # serve's default: a pool sized from memory, so always bounded
        (["--max-pages", "64"], True),
        (["--max-pages", "64", "--no-prefix-cache"], False),
        (["--page-size", "16"], True),
        (["--no-prefix-cache"], False),
        (["--dense"], False),  # dense caches: nothing to share
    ],
)
def test_prefix_cache_default(serve_module, flags, on):
    assert serve_module.parse_args(flags).prefix_cache is on


def test_serve_defaults_are_the_fast_design(serve_module):
    """serve's defaults are the course's fastest design, not batch-main's teaching ones."""
    args = serve_module.parse_args([])
    got = (args.policy, args.page_size, args.read_in_place, args.prefix_cache, args.batch_size)
    assert got == ("hybrid", 16, True, True, 8), (
        "serve should default to the hybrid policy over 16-token pages read in place, with the "
        f"prefix cache and 8 slots; got (policy, page size, in place, prefix cache, slots) {got}"
    )
    assert args.max_pages is None and args.max_seq_len is None, "sized from memory at start-up"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--dense", "--max-pages", "64"], "--max-pages is about KV pages, and --dense asks"),
        (["--dense", "--gather"], "--gather is about KV pages, and --dense asks"),
        (["--dense", "--prefix-cache"], "--prefix-cache is about KV pages, and --dense asks"),
        (["--memory-fraction", "0"], "--memory-fraction: expected a number above 0 and at most"),
        (["--memory-fraction", "1.5"], "--memory-fraction: expected a number above 0 and at most"),
        (["--memory-fraction", "half"], "--memory-fraction: expected a number, got 'half'"),
    ],
)
def test_dense_and_memory_usage_errors(serve_module, capsys, flags, words):
    with pytest.raises(SystemExit) as exit_:
        serve_module.parse_args(flags)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_the_pool_and_context_are_sized_from_memory(tmp_path):
    """Without --max-pages or --max-seq-len, the context is the model's positions (the tiny
    model's 2048) and the pool twice what the slots hold at that context, which the start-up
    line says."""
    s = Server(tmp_path, "--batch-size", "2")
    try:
        out = s.out.read_text()
        assert re.search(r"KV memory: --memory-fraction 0\.5 of the .* GiB MLX may use", out), out
        # room for both slots at 2048 tokens (128 pages of 16), and as much again for the cache
        assert "at most 512 pages per layer (8,192 tokens" in out, out
        assert "context 2,048 tokens (the model's positions)" in out, out
        assert "hybrid policy" in out and "read in place, prefix cache" in out, out
    finally:
        s.stop()


def test_a_share_too_small_for_the_slots_is_refused(tmp_path):
    result = serve_until_it_stops(
        offline_env(tmp_path), "--port", "0", "--memory-fraction", "0.000001"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "--memory-fraction 1e-06 of the" in last and "too few for --batch-size 8" in last, last
    assert "Traceback" not in result.stderr and "serving" not in result.stdout


def test_a_solution_without_the_prefix_cache_stops_at_start_up(tmp_path):
    """tiny_llm as the reference but with prefix_cache.py as the skeleton has it: the server,
    whose bounded pool turns the cache on by default, stops before it listens, naming the task
    and the flag that serves without it."""
    spec = importlib.util.spec_from_file_location("dev_tools", ROOT / "scripts" / "dev-tools.py")
    dev_tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev_tools)
    package = tmp_path / "student" / "tiny_llm"
    shutil.copytree(ROOT / "src" / "tiny_llm_ref", package)
    reference = (package / "prefix_cache.py").read_text()
    (package / "prefix_cache.py").write_text(dev_tools.skeleton_module(reference, "test")[0])
    line = unfinished_start_up(tmp_path, package, PAGED_FLAGS)
    assert "Week 4 Day 4, Task 1" in line
    assert line.endswith("; --no-prefix-cache serves the pages without Week 4 Day 4")


def serve_until_it_stops(env: dict, *flags: str) -> subprocess.CompletedProcess:
    """Run serve on the tiny model with `flags`, expecting it to stop before it listens."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--model", MODEL, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def unfinished_start_up(tmp_path, package, flags) -> str:
    """Start the server on the student package `package` with `flags`: it must stop before it
    listens, with one line saying that tiny_llm is not finished yet. That line."""
    env = offline_env(tmp_path, PYTHONPATH=str(package.parent))
    result = serve_until_it_stops(  # a copy of the reference: its C++ is not what is tested
        env,
        "--solution",
        "tiny_llm",
        "--port",
        "0",
        "--linear-kernel",
        "mlx",
        *ENGINE_FLAGS,
        *flags,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "serving" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tiny_llm is not finished yet: "), lines
    return lines[0]


# --- speculative decoding (Week 4 Day 5) ------------------------------------------------------------

# Prompts whose answers tend to repeat their input, so that prompt lookup finds something to copy:
# the chat questions, a completion that repeats a phrase, and the story with a question about it.
SPEC_CHATS = QUESTIONS[:4]
SPEC_TEXTS = [
    "the cat sat on the mat, the cat sat on the mat, the cat sat on the",
    STORY + ENDINGS[0],
]
SPEC_FLAGS = ["--speculative", "ngram", "--num-draft-tokens", "4"]


@pytest.fixture(scope="module")
def lookup_server(tmp_path_factory):
    """Prompt lookup over the main server's bounded paged pool (prefix cache and all)."""
    s = Server(tmp_path_factory.mktemp("serve-lookup"), *ENGINE_FLAGS, *PAGED_FLAGS, *SPEC_FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory):
    """The tiny chat model as its own draft, dense caches, the default number of guesses."""
    s = Server(tmp_path_factory.mktemp("serve-draft"), *ENGINE_FLAGS, "--speculative", MODEL)
    yield s
    s.stop()


def assert_greedy_answers_as_without_speculation(s: Server, ref: Reference) -> None:
    """Every SPEC prompt at once (their guesses checked in the same passes), each answer the
    text the engine gives it alone without speculation."""
    max_tokens = 40
    jobs = [("chat", q, ref.chat_ids(q)) for q in SPEC_CHATS]
    jobs += [("text", t, ref.tokenizer.encode(t)) for t in SPEC_TEXTS]
    client = s.client()

    def answer(job) -> tuple[str, str]:
        kind, prompt, _ = job
        if kind == "chat":
            r = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                temperature=0,
                max_tokens=max_tokens,
            )
            return r.choices[0].message.content, r.choices[0].finish_reason
        r = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens
        )
        return r.choices[0].text, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(answer, jobs))
    for (kind, prompt, ids), answer_ in zip(jobs, got):
        assert answer_ == ref.run(ids, max_tokens)[:2], f"{kind} {prompt[:40]!r}"


def spec_metrics(s: Server) -> tuple[float, float, float]:
    """(proposed, accepted, rate) from /metrics, their types checked."""
    typed_metrics(
        s,
        ("tiny_llm_spec_tokens_proposed_total", "counter"),
        ("tiny_llm_spec_tokens_accepted_total", "counter"),
        ("tiny_llm_spec_acceptance_rate", "gauge"),
    )
    m = s.metrics()
    proposed = m["tiny_llm_spec_tokens_proposed_total"]
    accepted = m["tiny_llm_spec_tokens_accepted_total"]
    rate = m["tiny_llm_spec_acceptance_rate"]
    assert 0 <= accepted <= proposed
    assert rate == pytest.approx(accepted / proposed if proposed else 0, abs=1e-6)
    return proposed, accepted, rate


def test_prompt_lookup_answers_as_without_it(lookup_server, ref):
    out = lookup_server.out.read_text()
    assert "hybrid policy" in out  # --speculative brought the hybrid policy with it
    assert "speculative decoding: prompt lookup, up to 4 guesses per request and pass" in out
    assert spec_metrics(lookup_server)[0] == 0  # nothing guessed before any request
    assert_greedy_answers_as_without_speculation(lookup_server, ref)
    proposed, _, _ = spec_metrics(lookup_server)
    assert proposed > 0
    # sampling goes through the accept rule of Task 3: an answer, whatever it says
    r = lookup_server.client().completions.create(
        model=MODEL, prompt=SPEC_TEXTS[0], temperature=0.8, seed=1, max_tokens=12
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    assert lookup_server.metrics()["tiny_llm_kv_pages_in_use"] == 0  # the guesses' pages too


def test_draft_model_answers_as_without_it(draft_server, ref):
    assert "speculative decoding: draft model tiny, up to 4 guesses" in draft_server.out.read_text()
    assert_greedy_answers_as_without_speculation(draft_server, ref)
    proposed, accepted, _ = spec_metrics(draft_server)
    assert proposed > 0 and accepted > 0  # a model agrees with itself (greedy)


def test_no_speculation_counts_nothing(server):
    assert spec_metrics(server) == (0, 0, 0)
    assert "speculative" not in server.out.read_text()


@pytest.mark.parametrize(
    "flags, policy, k",
    [
        ([], "hybrid", None),  # serve's default (batch-main's is alternate)
        (["--policy", "alternate"], "alternate", None),
        (["--speculative", "ngram"], "hybrid", 4),  # the hybrid policy without asking
        (["--speculative", "tiny", "--policy", "hybrid", "--num-draft-tokens", "2"], "hybrid", 2),
        (["--speculative", "ngram", "--policy", "alternate"], "alternate", 4),
    ],
)
def test_speculative_defaults(serve_module, flags, policy, k):
    args = serve_module.parse_args(flags)
    assert (args.policy, args.num_draft_tokens) == (policy, k)


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--speculative", "ngram", "--num-draft-tokens", "0"],
            "argument --num-draft-tokens: expected an integer >= 1, got 0",
        ),
        (["--num-draft-tokens", "2"], "--num-draft-tokens is how many tokens --speculative"),
        (["--speculative", ""], "argument --speculative: expected 'ngram' or a draft model"),
    ],
)
def test_speculative_usage_errors(serve_module, capsys, flags, words):
    with pytest.raises(SystemExit) as exit_:
        serve_module.parse_args(flags)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("serve: error: ") and words in last


@pytest.mark.parametrize("draft", ["missing-dir", "no-such-model"])
def test_unknown_draft_is_a_usage_error(serve_module, capsys, tmp_path, draft):
    source = str(tmp_path / draft) if draft == "missing-dir" else draft
    assert serve_module.main(["--port", "0", "--speculative", source]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --speculative {source}: "), lines
    assert ("not found" if draft == "missing-dir" else "unknown model") in lines[0]
    assert "'ngram'" in lines[0]


def test_draft_of_another_vocabulary_is_refused_at_start_up(tmp_path):
    """tiny-random's tokenizer is not the tiny chat model's: stopped before serving."""
    result = serve_until_it_stops(
        offline_env(tmp_path), "--port", "0", "--speculative", "tiny-random"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "vocabulary" in lines[0], lines
    assert "'tiny-random' has a vocabulary of" in lines[0] and "'tiny' one of" in lines[0]
    assert "serving" not in result.stdout


def test_a_solution_without_speculation_stops_at_start_up(tmp_path):
    """tiny_llm as the reference but with speculative.py as the skeleton has it: asked for
    --speculative, the server stops before it listens, naming the task and saying it serves
    without the flag."""
    package = tmp_path / "student" / "tiny_llm"
    shutil.copytree(ROOT / "src" / "tiny_llm_ref", package)
    shutil.copy(ROOT / "src" / "tiny_llm" / "speculative.py", package / "speculative.py")
    line = unfinished_start_up(tmp_path, package, SPEC_FLAGS)
    assert "Week 4 Day 5, Task 1" in line
    assert line.endswith("; without --speculative the server runs without Week 4 Day 5")


@pytest.mark.parametrize(
    "task", [None, "lookup", "accept_greedy", "accept_sampled", "keep_checked"]
)
def test_start_up_reaches_every_task_of_the_day(ref, monkeypatch, task):
    """check_proposer calls each task a request would reach (here one at a time left unwritten)
    and, when all are written, counts nothing."""
    from tiny_llm_support import speculative_settings

    message = f"Week 4 Day 5: {task} is not written"
    if task is not None:

        def unwritten(*args, **kwargs):
            raise NotImplementedError(message)

        monkeypatch.setattr(tiny_llm_ref.speculative, task, unwritten)
    proposer = tiny_llm_ref.PromptLookup(num_draft_tokens=4)
    if task is None:
        speculative_settings.check_proposer(tiny_llm_ref, proposer, ref.model, ref.tokenizer)
        assert (proposer.proposed, proposer.accepted) == (0, 0)
        return
    with pytest.raises(NotImplementedError, match=message):
        speculative_settings.check_proposer(tiny_llm_ref, proposer, ref.model, ref.tokenizer)


# --- a chat without text (issue 33) -----------------------------------------------------------

BLANK_CHATS = [
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": " \n\t"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "   "}],
    [{"role": "user", "content": [{"type": "text", "text": "  "}]}],
]


@pytest.mark.parametrize("messages", BLANK_CHATS)
def test_a_chat_without_text_is_refused_as_the_demos_refuse_it(server, messages):
    """The chat template would wrap nothing, and the model would answer its markup: 400, with
    the line main.py prints for such a prompt."""
    status, _, raw = request(server.port, "POST", CHAT, {"model": MODEL, "messages": messages})
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["param"] == "messages"
    assert error["message"].startswith("the prompt is empty or only whitespace")

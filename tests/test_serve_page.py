"""The live page of serve.py (Week 4 Day 3): GET / and the engine's snapshots on GET /events.

Support code, like tests/test_serve.py, whose Server starts serve.py here too (reference
package, tiny model, a free port on 127.0.0.1); this server has an API key, so the page's key
prompt is tested as well. The plain HTTP tests read the files and the event stream; the
browser tests open the page in the system's headless Chromium, driven by Playwright as
scripts/book-check.py drives it (no browser is downloaded). Without a Chromium the browser tests
skip and say so; with TINY_LLM_REQUIRE_BROWSER=1 they fail instead.
"""

import asyncio
import http.client
import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from test_serve import API_KEY, MAX_SEQ_LEN, Server
from test_serve import request as http_request

from tiny_llm_support import server_channels

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 16  # small chunks: a chat prompt takes two or three passes to prefill
FLAGS = ["--max-seq-len", str(MAX_SEQ_LEN), "--batch-size", "3", "--policy", "hybrid"]
FLAGS += ["--prefill-step", str(BUDGET), "--page-size", "16", "--max-pages", "32"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STATIC = ROOT / "src" / "tiny_llm_support" / "static"
# where the server writes the engine's latest snapshot into the page (not with --api-key)
FIRST_SNAPSHOT = '<script id="first-snapshot" type="application/json">null</script>'
REQUIRE_BROWSER = os.environ.get("TINY_LLM_REQUIRE_BROWSER") == "1"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-page"), *FLAGS, "--api-key", API_KEY)
    yield s
    s.stop()


def chat(port: int, question: str, max_tokens: int = 12, ignore_eos: bool = False) -> dict:
    status, _, body = http_request(
        port,
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "ignore_eos": ignore_eos,
        },
        headers=AUTH,
    )
    assert status == 200, body
    return json.loads(body)


class EventStream:
    """GET /events, read one server-sent event at a time."""

    def __init__(self, port: int, headers: dict | None = None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.conn.request("GET", "/events", headers=headers or {})
        self.response = self.conn.getresponse()

    def next(self) -> dict | None:
        """The next snapshot, or None when the stream has ended."""
        while True:
            line = self.response.readline()
            if not line:
                return None
            if line.startswith(b"data: "):
                return json.loads(line[len(b"data: ") :])

    def close(self) -> None:
        self.conn.close()


# --- plain HTTP ----------------------------------------------------------------------------------


def test_the_page_and_its_files_need_no_key(live):
    status, headers, body = http_request(live.port, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    html = body.decode()
    assert '<script src="/static/live.js"' in html and 'href="/static/live.css"' in html
    assert '<meta name="api-key" content="required">' in html  # the page asks for the key
    assert "http://" not in html.replace("http://127.0.0.1", "")  # nothing from another site
    for name, kind in [("live.js", "text/javascript"), ("live.css", "text/css")]:
        status, headers, _ = http_request(live.port, "GET", f"/static/{name}")
        assert status == 200 and headers["content-type"].startswith(kind)
    status, _, body = http_request(live.port, "GET", "/static/server.py")
    assert status == 404 and "no such file" in json.loads(body)["error"]["message"]


def test_the_page_has_one_place_for_a_snapshot(live):
    """The server writes its latest snapshot in place of the null, but not with --api-key (the
    page holds no data until the key is given), as this server has."""
    status, _, body = http_request(live.port, "GET", "/")
    html = body.decode()
    assert status == 200 and html.count(FIRST_SNAPSHOT) == 1
    assert html.count('id="first-snapshot"') == 1


def test_events_need_the_key(live):
    status, _, body = http_request(live.port, "GET", "/events")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_events_stream_the_engine_while_it_runs(live):
    stream = EventStream(live.port, AUTH)
    try:
        assert stream.response.getheader("content-type").startswith("text/event-stream")
        first = stream.next()  # sent at once, though the engine is idle
        assert first["config"] == {
            "policy": "hybrid", "batch_size": 3, "budget": BUDGET,
            "max_seq_len": MAX_SEQ_LEN, "speculative": False,
        }  # fmt: skip
        finished = first["stats"]["requests_finished"]
        answers = []
        # 48 tokens whatever the answer (~7 ms a step): decoding spans several snapshots, which
        # come at most 20 a second; a short answer could start and end between two of them
        ask = lambda: answers.append(chat(live.port, "Who are you?", 48, ignore_eos=True))
        sender = threading.Thread(target=ask)
        sender.start()
        states, chunked, decoded = set(), False, False
        while True:
            snapshot = stream.next()
            assert snapshot is not None, "the stream ended while the server runs"
            states |= {slot["state"] for slot in snapshot["slots"] if slot is not None}
            for p in snapshot["passes"]:
                chunked |= bool(p["chunks"])
                decoded |= p["decode"] > 0
                assert p["budget"] == BUDGET and p["padding"] == 0  # hybrid, not compiled
                assert p["decode"] + sum(t for _, t in p["chunks"]) <= BUDGET
            if snapshot["stats"]["requests_finished"] > finished:
                break
        sender.join(timeout=30)
        # the last snapshot is the idle engine: every slot free, the pages back or cached
        assert snapshot["slots"] == [None, None, None] and snapshot["queue"] == []
        pages = snapshot["pages"]
        assert pages["in_use"] == 0 and pages["cached"] + pages["free"] == pages["total"] == 32
        kinds = [e["kind"] for e in snapshot["events"]]
        assert "admit" in kinds and "finish" in kinds
        assert "decoding" in states and chunked and decoded
        assert answers and answers[0]["choices"][0]["message"]["content"]
    finally:
        stream.close()


def test_a_slow_client_loses_the_oldest_snapshots():
    """Nobody waits for a slow page: a subscriber keeps only its latest snapshots."""

    async def main():
        subscriber = server_channels.Subscriber()
        for i in range(100):
            subscriber.put(str(i))
        got = [await subscriber.next(timeout=1) for _ in range(server_channels.SNAPSHOTS_QUEUED)]
        assert await subscriber.next(timeout=0.01) == ""  # nothing left: a keep-alive
        subscriber.put(None)
        return got, await subscriber.next(timeout=1)

    got, end = asyncio.run(main())
    assert got == [str(i) for i in range(100 - server_channels.SNAPSHOTS_QUEUED, 100)]
    assert end is None


# --- in a browser --------------------------------------------------------------------------------


def chromium_or_skip() -> tuple[str, list[str], ModuleType]:
    """The system Chromium, book-check's flags for it and book-check itself; a skip (a failure under
    TINY_LLM_REQUIRE_BROWSER=1) where there is none."""
    spec = importlib.util.spec_from_file_location("book_check", ROOT / "scripts" / "book-check.py")
    book_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(book_check)
    chromium = book_check.find_chromium(os.environ.get("BOOK_CHECK_CHROMIUM"))
    problem = None
    if chromium is None:
        problem = "no Chromium installed (Debian/Ubuntu: apt-get install chromium)"
    elif importlib.util.find_spec("playwright") is None:
        problem = "Playwright is not installed (pdm sync -G book)"
    if problem is not None:
        if REQUIRE_BROWSER:
            pytest.fail(f"{problem} (TINY_LLM_REQUIRE_BROWSER=1: the browser test must run)")
        pytest.skip(f"the browser test needs a browser: {problem}")
    return chromium, book_check.CHROMIUM_FLAGS, book_check


# Runs in the page: remembers every state the slot table shows, however briefly.
WATCH_SLOTS = """() => {
  window.slotStates = new Set();
  new MutationObserver(() => {
    for (const row of document.querySelectorAll("#slots tr[data-state]"))
      window.slotStates.add(row.dataset.state);
  }).observe(document.getElementById("slots"), { childList: true, subtree: true });
}"""


def is_chat(request) -> bool:
    return request.method == "POST" and request.url.endswith("/v1/chat/completions")


def test_the_page_in_a_browser(live):
    chromium, flags, book_check = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    base = f"http://127.0.0.1:{live.port}/"
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        try:
            page = browser.new_page()
            book_check.watch(page, base, problems)  # errors, and no request off the server
            page.goto(base)
            # with --api-key the server writes no snapshot into the page: it waits for /events
            assert "waiting for the first snapshot" in page.text_content("#config")
            page.fill("#api-key", API_KEY)  # the server has --api-key: the page asks for it
            page.click("#key-form button")
            page.wait_for_selector("#connection.live", timeout=10_000)
            page.wait_for_selector("#model:text('tiny')", timeout=10_000)
            page.evaluate(WATCH_SLOTS)
            page.fill("#prompt", "What is a KV cache?")
            page.fill("#max-tokens", "12")  # its prompt's chunks stay in the latest passes
            # the temperature control: labelled, greedy (0) unless changed, sent with the chat
            assert page.get_by_label("temperature").input_value() == "0"
            with page.expect_request(is_chat) as sent:
                page.click("#send")
            assert sent.value.post_data_json["temperature"] == 0
            answer = page.wait_for_selector(".message.answer[data-done]", timeout=30_000)
            assert answer.query_selector(".text").text_content().strip(), "no answer text"
            assert "finish:" in answer.query_selector(".note").text_content()
            # the engine's view: the request in a slot, its passes, the page pool, the events
            states = set(page.evaluate("() => [...window.slotStates]"))
            assert states & {"prefilling", "decoding"}, f"the slots only showed {states}"
            page.wait_for_function(
                "() => document.querySelectorAll('#slots tr[data-state=free]').length === 3"
            )
            assert page.locator("#passes .pass").count() >= 2
            assert page.locator("#passes .seg.decode").count() >= 1
            assert page.locator("#passes .seg.chunk").count() >= 1
            assert "of 32 pages of 16 tokens" in page.text_content("#pages")
            assert "finished" in page.text_content("#events")
            # a warmer answer: the control's new value goes with the next request
            page.fill("#temperature", "0.7")
            page.fill("#prompt", "Tell me a short story about a cat.")
            with page.expect_request(is_chat) as sent:
                page.click("#send")
            assert sent.value.post_data_json["temperature"] == 0.7
            page.wait_for_function(
                "() => document.querySelectorAll('.message.answer[data-done]').length === 2",
                timeout=30_000,
            )
        finally:
            browser.close()
    assert problems == [], problems


def busy_snapshot(port: int) -> dict:
    """A snapshot from /events while a chat runs: a request in a slot, a pass behind it."""
    stream = EventStream(port, AUTH)
    try:
        finished = stream.next()["stats"]["requests_finished"]
        sender = threading.Thread(target=chat, args=(port, "What is a KV cache?", 40))
        sender.start()
        found = None
        while (snapshot := stream.next()) is not None:
            if found is None and snapshot["passes"] and any(snapshot["slots"]):
                found = snapshot
            if snapshot["stats"]["requests_finished"] > finished:
                break
        sender.join(timeout=30)
    finally:
        stream.close()
    assert found is not None, "no snapshot showed the chat in a slot"
    return found


def test_the_page_draws_the_snapshot_it_holds(live):
    """A page served with a snapshot in it (as the server serves it without --api-key) shows
    the engine at once, /events or not: here /events is refused, so a headless screenshot,
    which never waits for a stream, shows the engine and not "waiting for the first
    snapshot". The page is index.html with a real snapshot written in, as the server writes it
    (every "<" as \\u003c); its two files come from the server."""
    chromium, flags, _ = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    snapshot = busy_snapshot(live.port)
    data = json.dumps(snapshot).replace("<", "\\u003c")
    html = (STATIC / "index.html").read_text()
    assert html.count(FIRST_SNAPSHOT) == 1
    html = html.replace(FIRST_SNAPSHOT, FIRST_SNAPSHOT.replace("null", data))
    base = f"http://127.0.0.1:{live.port}/"
    problems: list[str] = []
    refused: list[str] = []

    def serve(route, request):
        if request.url == base:
            route.fulfill(status=200, content_type="text/html", body=html)
        elif request.url.startswith(base + "static/"):
            route.continue_()
        else:  # /events, /v1/models and anything else: no data but the page's own
            refused.append(request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
            page.route("**/*", serve)
            page.goto(base)
            page.wait_for_selector("#connection.down", timeout=10_000)  # /events failed
            assert base + "events" in refused
            config = page.text_content("#config")
            assert "waiting for the first snapshot" not in config
            assert "hybrid policy" in config and "3 decode slots" in config
            states = page.eval_on_selector_all(
                "#slots tbody tr", "rows => rows.map(row => row.dataset.state)"
            )
            assert states == ["free" if r is None else r["state"] for r in snapshot["slots"]]
            assert set(states) & {"prefilling", "decoding"}
            assert page.locator("#passes .pass").count() == len(snapshot["passes"])
            pages = snapshot["pages"]
            assert f"{pages['in_use']} in use" in page.text_content("#pages")
            assert "of 32 pages of 16 tokens" in page.text_content("#pages")
            assert page.locator("#counters dt").count() >= 1
        finally:
            browser.close()
    assert problems == [], problems


# --- last: it stops the server ---------------------------------------------------------------------


def test_sigterm_ends_the_event_streams(live):
    """An open /events stream does not hold the server up: it ends when the engine stops."""
    stream = EventStream(live.port, AUTH)
    assert stream.next() is not None
    ended = []
    reader = threading.Thread(target=lambda: ended.append(drain(stream)))
    reader.start()
    t = time.monotonic()
    assert live.stop(signal.SIGTERM) == 0
    reader.join(timeout=10)
    assert ended == [True] and time.monotonic() - t < 10
    stream.close()


def drain(stream: EventStream) -> bool:
    while stream.next() is not None:
        pass
    return True

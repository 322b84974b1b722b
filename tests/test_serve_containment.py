"""serve.py cannot be stopped by a request (issue 40): the engine runs in a process of its own,
a failure inside it fails only the requests it touched (an OpenAI error, every page back), and
an engine process that dies is noticed, reported on /health and started again.

The failures are real bugs planted in a copy of the reference solution, served as the student
package (--solution tiny_llm, found first on PYTHONPATH): one in Engine.add_request for a
request with seed 7 (also the second of n answers seeded 6), one in a step whenever a request
samples at temperature 1.5, and one in Engine.score (echo's prompt logprobs) when asked for 7
top tokens.
"""

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from test_serve import (
    ENGINE_FLAGS,
    LONG,
    MAX_PAGES,
    MODEL,
    PAGED_FLAGS,
    TEXT,
    Server,
    raw_post,
    request,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
PLANTED = """

# --- bugs planted by tests/test_serve_containment.py ---
_add_request, _iterate, _score = Engine.add_request, Engine.iterate, Engine.score


def _add_request_with_a_bug(self, prompt, params=None):
    if params is not None and params.seed == 7:
        raise TypeError("a bug planted in add_request")
    return _add_request(self, prompt, params)


def _iterate_with_a_bug(self):
    if any(s.params.temperature == 1.5 for s in self.streams.values()):
        raise RuntimeError("a bug planted in the step")
    return _iterate(self)


def _score_with_a_bug(self, prompt, k=0):
    if k == 7:
        raise RuntimeError("a bug planted in score")
    return _score(self, prompt, k)


Engine.add_request, Engine.iterate = _add_request_with_a_bug, _iterate_with_a_bug
Engine.score = _score_with_a_bug
"""


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """The main server's settings over the reference with the planted bugs."""
    tmp = tmp_path_factory.mktemp("serve-faulty")
    package = tmp / "packages" / "tiny_llm"
    shutil.copytree(ROOT / "src" / "tiny_llm_ref", package)
    with open(package / "engine.py", "a") as f:
        f.write(PLANTED)
    s = Server(  # the kernel of Week 5 Day 4 is not what is tested: MLX's matmul
        tmp,
        *ENGINE_FLAGS,
        *PAGED_FLAGS,
        "--linear-kernel",
        "mlx",
        solution="tiny_llm",
        PYTHONPATH=str(package.parent),
    )
    yield s
    s.stop()


def health(server: Server) -> tuple[int, dict]:
    status, _, body = request(server.port, "GET", "/health")
    return status, json.loads(body)


def complete(server: Server, **fields) -> tuple[int, dict]:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **fields}
    status, _, raw = request(server.port, "POST", TEXT, body)
    return status, json.loads(raw)


def stream_events(sock) -> list[dict]:
    """Read a raw streamed response to its end: its data events, [DONE] left out."""
    received = b""
    sock.settimeout(60)
    while chunk := sock.recv(65536):
        received += chunk
        if b"data: [DONE]" in received:
            break
    sock.close()
    return [json.loads(e) for e in re.findall(rb"^data: (\{.*\})\r?$", received, re.M)]


def assert_serving(server: Server, why: str) -> None:
    status, body = complete(server, temperature=0)
    assert status == 200, f"{why}: a plain request then got {status} {body}"
    m = server.metrics()
    assert m["tiny_llm_kv_pages_in_use"] == 0 and m["tiny_llm_requests_running"] == 0, (
        f"{why}: pages or slots still held afterwards ({m})"
    )


def test_a_request_that_breaks_add_request_fails_alone(faulty):
    sock = raw_post(faulty.port, TEXT, {**LONG, "max_tokens": 60, "stream": True, "temperature": 0})
    status, body = complete(faulty, seed=7, temperature=0.5)
    assert status == 500, body
    assert body["error"]["type"] == "server_error"
    assert "a bug planted in add_request" in body["error"]["message"]
    events = stream_events(sock)
    assert "error" not in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length", (
        "a request that failed to be added must not disturb the others in flight"
    )
    assert health(faulty)[1]["engine_failures"] == 0  # refused alone: no step failed
    assert_serving(faulty, "after a failed add")


def test_choices_that_break_half_way_leave_nothing_behind(faulty):
    """n=3 with seed 6: answer 1 samples with seed 7, whose add_request raises after answer 0
    was queued. The request fails alone, and answer 0 is aborted, not left running for no
    one (its slot and pages back)."""
    aborted = faulty.metrics()["tiny_llm_requests_aborted_total"]
    status, body = complete(faulty, seed=6, temperature=0.5, n=3, max_tokens=100)
    assert status == 500 and "a bug planted in add_request" in body["error"]["message"], body
    wait_until(lambda: faulty.metrics()["tiny_llm_requests_aborted_total"] == aborted + 1, 10,
               "the answer queued before the failure is aborted")  # fmt: skip
    assert_serving(faulty, "after choices failed half way")


def test_a_prompt_that_breaks_score_fails_alone(faulty):
    """echo with logprobs scores the prompt in the engine process between two steps: a failure
    there ends that request (and its generation, already added) only."""
    sock = raw_post(faulty.port, TEXT, {**LONG, "max_tokens": 60, "stream": True, "temperature": 0})
    for max_tokens in (0, 4):
        status, body = complete(faulty, echo=True, logprobs=7, max_tokens=max_tokens)
        assert status == 500 and "a bug planted in score" in body["error"]["message"], body
    events = stream_events(sock)
    assert "error" not in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length", (
        "a prompt that failed to be scored must not disturb the requests in flight"
    )
    assert health(faulty)[1]["engine_failures"] == 0  # refused alone: no step failed
    status, body = complete(faulty, echo=True, logprobs=2, max_tokens=0)
    assert status == 200 and body["choices"][0]["logprobs"]["token_logprobs"][0] is None, body
    assert_serving(faulty, "after a failed score")


def test_a_step_that_raises_fails_its_requests_and_serving_goes_on(faulty):
    pid = health(faulty)[1]["engine_pid"]
    sock = raw_post(
        faulty.port, TEXT, {**LONG, "max_tokens": 100, "stream": True, "temperature": 0}
    )
    wait_until(lambda: faulty.metrics()["tiny_llm_requests_running"] == 1, 20, "it runs")
    status, body = complete(faulty, temperature=1.5)
    assert status == 500 and "a bug planted in the step" in body["error"]["message"], body
    last = stream_events(sock)[-1]
    assert last.get("error", {}).get("type") == "server_error", (
        f"the request in the failed step must end with an error event, got {last}"
    )
    status, now = health(faulty)
    assert status == 200 and now["status"] == "ok" and now["engine_pid"] == pid, now
    assert now["engine_failures"] == 1 and "a bug planted in the step" in now["last_failure"]
    assert faulty.metrics()["tiny_llm_engine_failures_total"] == 1
    assert_serving(faulty, "after a failed step")
    assert "a bug planted in the step" in faulty.err.read_text()  # the traceback is logged


def test_a_dead_engine_process_is_reported_and_replaced(faulty):
    """SIGKILL the engine mid-stream: the stream ends with an error, /health says so while a
    new engine starts, then serves again."""
    before = health(faulty)[1]
    sock = raw_post(
        faulty.port, TEXT, {**LONG, "max_tokens": 150, "stream": True, "temperature": 0}
    )
    wait_until(lambda: faulty.metrics()["tiny_llm_requests_running"] == 1, 20, "it runs")
    seen = []
    watcher = threading.Thread(target=lambda: seen.extend(watch_health(faulty, 60)))
    watcher.start()
    os.kill(before["engine_pid"], signal.SIGKILL)
    last = stream_events(sock)[-1]
    assert "engine process ended" in last.get("error", {}).get("message", ""), last
    watcher.join()
    assert (503, "restarting") in seen, f"/health never said it was restarting: {seen}"
    status, after = health(faulty)
    assert status == 200 and after["engine_pid"] != before["engine_pid"], after
    assert after["restarts"] == before["restarts"] + 1
    assert_serving(faulty, "after the engine process was replaced")
    assert faulty.metrics()["tiny_llm_kv_pages_free"] == MAX_PAGES
    assert faulty.proc.poll() is None


def watch_health(server: Server, timeout: float) -> list[tuple[int, str]]:
    """/health's (status, state) every 20 ms, until it is ok again after a change."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = health(server)
        if not seen or seen[-1] != (status, body["status"]):
            seen.append((status, body["status"]))
        if len(seen) > 1 and status == 200:
            break
        time.sleep(0.02)
    return seen


def test_the_engine_process_ends_with_the_server(tmp_path):
    """SIGKILL the server itself (no clean-up runs): its engine process sees the pipe close and
    ends too, instead of holding the model's memory as an orphan."""
    s = Server(tmp_path, *ENGINE_FLAGS)
    try:
        pid = health(s)[1]["engine_pid"]
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(timeout=10)
        wait_until(lambda: not alive(pid), 20, f"the engine process {pid} ends")
    finally:
        s.stop(signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether a process runs (on Linux, a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # no /proc here, or the process has just gone
        return not os.path.isdir("/proc")
    return state != "Z"

"""serve.py on a solution whose Week 4 Day 8 tasks are not written yet (--solution tiny_llm):
plain requests are served, and a request that needs logprobs, a grammar (response_format, an
enforced tool call) or n > 1 forks is refused with a 400 naming the day, the task and the field,
before it reaches the engine, where its NotImplementedError would fail every request in flight.

The engine process finds the missing tasks at start-up (server_features.probe, checked here task
by task on the reference) and says so in its "ready" message. The served student package is the
reference with logprobs.py, structured_output.py and fork.py as the skeleton has them.
"""

import concurrent.futures
import json
import shutil

import pytest
from test_serve import ENGINE_FLAGS, LONG, MODEL, PAGED_FLAGS, ROOT, Server, request

import tiny_llm
import tiny_llm_ref
from tiny_llm_support.server_features import probe

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
TASKS = [  # (feature, module, function, task, the name the message gives)
    ("logprobs", "logprobs", "token_logprobs", "Week 4 Day 8, Task 1", "token_logprobs"),
    ("grammar", "structured_output", "mask_rows", "Week 4 Day 8, Task 2", "mask_rows"),
    ("grammar", "structured_output", "Grammar.advance", "Week 4 Day 8, Task 3", "Grammar.advance"),
    ("grammar", "structured_output", "Grammar.guess_masks", "Week 4 Day 8, Task 4",
     "Grammar.guess_masks"),
    ("choices", "paged_kv_cache", "TinyKvPagedCache.copy_on_write", "Week 4 Day 8, Task 5",
     "copy_on_write"),
    ("choices", "fork", "fork_prefix", "Week 4 Day 8, Task 6", "fork_prefix"),
]  # fmt: skip


def test_the_reference_has_every_feature():
    assert probe(tiny_llm_ref, shares_pages=True, speculative=True) == {}


def test_the_skeleton_misses_each_feature_at_its_first_task():
    missing = probe(tiny_llm, shares_pages=True, speculative=True)
    assert missing == {
        "logprobs": "Week 4 Day 8, Task 1 (token_logprobs) is not written yet in tiny_llm",
        "grammar": "Week 4 Day 8, Task 2 (mask_rows) is not written yet in tiny_llm",
        "choices": "Week 4 Day 8, Task 5 (copy_on_write) is not written yet in tiny_llm",
    }, missing
    assert "choices" not in probe(tiny_llm, shares_pages=False, speculative=False), (
        "without sharing pools n answers prefill each and need no fork: nothing is missing"
    )


@pytest.mark.parametrize("feature, module, function, task, named", TASKS, ids=[t[2] for t in TASKS])
def test_the_probe_reaches_every_task(monkeypatch, feature, module, function, task, named):
    """Each task left unwritten alone (on the reference) is found and named."""
    owner, _, name = function.rpartition(".")
    target = getattr(tiny_llm_ref, module)
    target = getattr(target, owner) if owner else target

    def unwritten(*args, **kwargs):
        raise NotImplementedError(f"{task}: not written")

    monkeypatch.setattr(target, name, unwritten)
    missing = probe(tiny_llm_ref, shares_pages=True, speculative=True)
    assert missing == {feature: f"{task} ({named}) is not written yet in tiny_llm_ref"}, missing


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-unfinished")
    package = tmp / "student" / "tiny_llm"
    shutil.copytree(ROOT / "src" / "tiny_llm_ref", package)
    for module in ("logprobs.py", "structured_output.py", "fork.py"):
        shutil.copy(ROOT / "src" / "tiny_llm" / module, package / module)
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


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "f"}}
REFUSED = [
    # (endpoint, fields, param, task and function)
    (CHAT, {"logprobs": True}, "logprobs", "Task 1 (token_logprobs)"),
    (TEXT, {"logprobs": 2}, "logprobs", "Task 1 (token_logprobs)"),
    (TEXT, {"echo": True, "logprobs": 0, "max_tokens": 0}, "logprobs", "Task 1 (token_logprobs)"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format", "Task 2 (mask_rows)"),
    (TEXT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                       SCHEMA}}},
     "response_format", "Task 2 (mask_rows)"),
    (CHAT, {"tools": [TOOL], "tool_choice": "required"}, "tool_choice", "Task 2 (mask_rows)"),
    (CHAT, {"n": 2}, "n", "Task 6 (fork_prefix)"),
    (TEXT, {"n": 3}, "n", "Task 6 (fork_prefix)"),
]  # fmt: skip


def test_missing_features_are_400s_and_requests_in_flight_go_on(server):
    """A long request runs while every refused one is sent: it finishes, and so does a plain
    request and one with tools that need no grammar (tool_choice "auto")."""
    before = server.metrics()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(request, server.port, "POST", TEXT, {**LONG, "max_tokens": 60,
                                                                "temperature": 0})  # fmt: skip
        for path, fields, param, task in REFUSED:
            base = {"model": MODEL, "max_tokens": 4}
            base |= {"messages": HI} if path == CHAT else {"prompt": "Hi"}
            status, _, raw = request(server.port, "POST", path, base | fields)
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == param, f"{fields}: {status} {raw[:300]}"
            expected = f"Week 4 Day 8, {task} is not written yet in tiny_llm"
            assert expected in error["message"], f"{expected!r} not in {error['message']!r}"
        status, _, raw = long.result(timeout=60)
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length", raw
    for path, fields in [(CHAT, {}), (TEXT, {}), (CHAT, {"tools": [TOOL], "tool_choice": "auto"})]:
        base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
        base |= {"messages": HI} if path == CHAT else {"prompt": "Hi"}
        status, _, raw = request(server.port, "POST", path, base | fields)
        assert status == 200, f"{fields}: {raw[:300]}"
    after = server.metrics()
    assert after["tiny_llm_engine_failures_total"] == before["tiny_llm_engine_failures_total"], (
        "a refused feature reached the engine and failed a step"
    )

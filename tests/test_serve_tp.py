"""serve --tp 2: the tensor-parallel model (Week 4 Day 2) behind the same server, two ranks
under mlx.launch (server_ranks.py). Greedy text through the official openai client equals one
rank's; a sampled request finishes; a rank that dies takes the server down with a line naming
it, never a hang. Like the 4.2 tests, these skip where two ranks cannot start, and fail
instead under TINY_LLM_REQUIRE_RANKS=1 (CI)."""

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import needs_ring
from test_serve import Server

pytestmark = needs_ring

QUESTIONS = ["What is the capital of France?", "Write a haiku about a cat.", "Why is the sky blue?"]


def answers(server: Server) -> list[str]:
    """Greedy answers to QUESTIONS, sent at once (they share the engine's passes)."""
    client = server.client()

    def ask(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(ask, QUESTIONS))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("one-rank"), "--max-seq-len", "512")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("two-ranks"), "--max-seq-len", "512", "--tp", "2")
    yield server
    server.stop()


def test_two_ranks_answer_as_one(one_rank, two_ranks):
    assert "tensor parallel: 2 ranks" in two_ranks.out.read_text()
    assert answers(two_ranks) == answers(one_rank), (
        "greedy answers through the server differ between two ranks and one: every rank must "
        "apply rank 0's operations of each turn in the same order and take the same step"
    )
    sampled = two_ranks.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12, temperature=0.8,
    )  # fmt: skip
    assert sampled.usage.completion_tokens > 0, "a sampled request (a seed chosen on rank 0)"


def test_two_ranks_score_prompts_and_follow_grammars_as_one(one_rank, two_ranks):
    """echo's prompt logprobs are a forward pass that every rank takes, in the same order
    (server_ranks.apply); a grammar travels with its request's settings. Afterwards the ranks
    still answer as one."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}

    def ask(server: Server) -> tuple:
        client = server.client()
        scored = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=0, echo=True, logprobs=2
        )
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "A color?"}], max_tokens=20,
            temperature=0, response_format=fmt,
        )  # fmt: skip
        return scored.choices[0].logprobs.token_logprobs, answer.choices[0].message.content

    (scores, text), (scores_1, text_1) = ask(two_ranks), ask(one_rank)
    assert text == text_1 and json.loads(text)["color"] in ("red", "blue"), (text, text_1)
    assert scores[0] is None and all(abs(a - b) < 1e-4 for a, b in zip(scores[1:], scores_1[1:]))
    assert answers(two_ranks) == answers(one_rank), "the ranks fell out of step after a score"


def test_two_ranks_fork_choices_and_call_tools_as_one(one_rank, two_ranks):
    """n answers are one operation (server_ranks.add_op with n: Engine.add_choices on every
    rank, forks and seeds alike); an enforced tool call's grammar travels with its settings."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}  # fmt: skip

    def ask(server: Server) -> tuple:
        client = server.client()
        choices = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], n=3,
            max_tokens=8, temperature=1.0, seed=4,
        )  # fmt: skip
        call = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Pick."}], max_tokens=60,
            tools=[tool], tool_choice="required", temperature=0,
        ).choices[0].message.tool_calls[0].function  # fmt: skip
        return [c.message.content for c in choices.choices], (call.name, call.arguments)

    assert ask(two_ranks) == ask(one_rank), "n choices or a tool call differ between ranks"
    assert answers(two_ranks) == answers(one_rank), "the ranks fell out of step after n choices"


def rank_processes(rank: int) -> list[int]:
    """The pids of this user's processes that mlx.launch started as `rank` of serve.py."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            command = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"MLX_RANK={rank}".encode() in environ and b"serve.py" in command:
            found.append(int(proc.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
def test_a_dead_rank_takes_the_server_down(tmp_path):
    server = Server(tmp_path, "--max-seq-len", "128", "--tp", "2")
    try:
        followers = rank_processes(1)
        assert followers, "rank 1 of serve --tp 2 not found"
        for pid in followers:
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        status = server.proc.wait(timeout=30)
    finally:
        server.stop()
    err = server.err.read_text()
    assert status != 0, f"the server exited with 0 after rank 1 died:\n{err}"
    assert time.monotonic() - start < 30
    assert re.search(r"rank 1\b", err), f"the error must name rank 1:\n{err}"

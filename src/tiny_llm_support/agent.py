"""A small agent on the course's server (Week 4 Day 8): the tool-calling loop, end to end.

    pdm run agent [--url URL | --model tiny|PATH] [--question TEXT] [--max-turns N]

It gives the model two local tools (agent_tools.py: a calculator and a lookup in the course's
Q&A file) and runs the loop that agent frameworks run: send the conversation with the tools; run
each call the answer makes and send the results back as `tool` messages; ask again, until the
model answers in text. The first turn sends tool_choice "required", so that even the tiny model
(which was never taught to call tools) makes a call, enforced by the server's grammar; the middle
turns "auto"; the last one "none", for an answer. Every step is printed, and the last line says
how it ended.

Without --url it starts `serve` on a free port of 127.0.0.1 itself (the shipped tiny chat model
by default: offline) and stops it at the end. The turns and the whole run are bounded
(--max-turns, --timeout); Ctrl-C stops it quietly (the server too).
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import startup
from .agent_tools import TOOLS, describe, run_call

ROOT = Path(__file__).resolve().parents[2]  # the repository, where serve.py is
SERVE = ROOT / "serve.py"
SERVING = re.compile(r"serving '.*' at (http://\S+/v1)")
DEFAULT_QUESTION = "What is 12 * (3 + 4)? And what is a KV cache?"
MAX_TOKENS = 128  # of each answer: a call (every argument bounded), or the final text
START_TIMEOUT_S = 120


class Stopped(Exception):
    """The run cannot go on: the server did not start, or --timeout has passed."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agent",
        description="A tool-calling agent (calculator, Q&A lookup) against the course's server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="an OpenAI-compatible server's /v1 URL (default: start serve)")
    where.add_argument("--model", default="tiny", help="the model serve loads when no --url")
    p.add_argument("--question", default=DEFAULT_QUESTION)
    p.add_argument("--max-turns", type=_at_least(2), default=4, help="requests to the model")
    p.add_argument("--timeout", type=_at_least(1), default=300, help="seconds for the whole run")
    p.add_argument("--api-key", default="none", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of every turn")
    return p.parse_args(argv)


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    try:
        import openai
    except ImportError:
        print("error: the agent needs the `openai` package (pdm's dev group)", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.timeout
    server = None
    try:
        url = args.url
        if url is None:
            server = LocalServer(args.model)
            url = server.wait_for_url(min(deadline, time.monotonic() + START_TIMEOUT_S))
            print(f"server: serve --model {args.model} at {url}", flush=True)
        client = openai.OpenAI(base_url=url, api_key=args.api_key, max_retries=0)
        agent = Agent(client, args, deadline)
        try:
            return agent.run()
        except openai.OpenAIError as e:
            print(f"status: failed, the server said: {e}", flush=True)
            return 1
    except Stopped as e:
        print(f"status: stopped, {e}", flush=True)
        return 1
    finally:
        if server is not None:
            server.stop()


class Agent:
    """The conversation, the loop, and its printout."""

    def __init__(self, client: Any, args: argparse.Namespace, deadline: float) -> None:
        self.client, self.args, self.deadline = client, args, deadline
        self.model = args.model if args.url is None else None  # else the server's (GET /models)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": args.question}]
        self.calls = 0

    def run(self) -> int:
        print(f"question: {self.args.question}", flush=True)
        for turn in range(1, self.args.max_turns + 1):
            last = turn == self.args.max_turns
            choice = "required" if turn == 1 else "none" if last else "auto"
            message = self.ask(turn, choice)
            calls = message.tool_calls or []
            if not calls:
                print(f"answer: {(message.content or '').strip()}", flush=True)
                print(f"status: answered after {turn} turns, {self.calls} tool calls", flush=True)
                return 0
            self.messages.append(assistant_turn(message.content, calls))
            for call in calls:
                self.calls += 1
                result = run_call(call.function.name, call.function.arguments)
                print(f"  call {call.function.name}({describe(call.function.arguments)})")
                print(f"    -> {describe(result)}", flush=True)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        print(f"status: no answer within {self.args.max_turns} turns", flush=True)
        return 1

    def ask(self, turn: int, choice: str) -> Any:
        """One request: the conversation so far with the tools; the answer's message."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Stopped(f"the run took longer than --timeout {self.args.timeout} s")
        print(f"turn {turn} (tool_choice {choice})", flush=True)
        client = self.client.with_options(timeout=left)
        if self.model is None:
            self.model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=self.model,
            messages=self.messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=self.args.seed + turn,
        )
        return r.choices[0].message


def assistant_turn(content: str | None, calls: list) -> dict[str, Any]:
    """An answer that called tools, as the conversation sends it back (content null if none)."""
    sent = [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                      "arguments": c.function.arguments}}
        for c in calls
    ]  # fmt: skip
    return {"role": "assistant", "content": content, "tool_calls": sent}


class LocalServer:
    """serve on a free port of 127.0.0.1, in a session of its own (Ctrl-C reaches only the
    agent, which stops it); its output goes to anonymous temporary files."""

    def __init__(self, model: str) -> None:
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        command = [sys.executable, str(SERVE), "--model", model, "--port", "0"]
        self.proc = subprocess.Popen(
            command, cwd=ROOT, stdout=self.out, stderr=self.err, start_new_session=True
        )

    def wait_for_url(self, deadline: float) -> str:
        """The server's /v1 URL once it serves; Stopped if it stops or takes too long."""
        while time.monotonic() < deadline:
            self.out.seek(0)
            found = SERVING.search(self.out.read())
            if found:
                return found[1]
            if self.proc.poll() is not None:
                self.err.seek(0)
                lines = self.err.read().strip().splitlines() or ["(no output)"]
                said = next((line for line in lines if line.startswith("error: ")), lines[-1])
                raise Stopped(f"serve did not start: {said.removeprefix('error: ')}")
            time.sleep(0.1)
        raise Stopped("serve did not start in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()
        self.err.close()


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(startup.run(main))

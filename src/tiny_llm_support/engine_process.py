"""The engine process of serve.py: the only process that runs the model.

The HTTP process (server_engine.EngineClient) starts this one and talks to it over a pipe
(multiprocessing's Connection: whole pickled messages). This process builds the engine, then
loops: take the commands waiting, take one engine step, send what it produced. With nothing to
do it sleeps on the pipe. Between the two processes no interpreter is shared, so a long forward
pass never delays the HTTP side's streaming, and nothing the engine raises can stop the server.

    HTTP -> engine   ("add", keys, prompt ids, SamplingParams)  a request, or with n keys n answers
                                                                 to one prompt (Engine.add_choices;
                                                                 `keys`: the HTTP side's)
                     ("abort", key)                              its client left
                     ("score", key, prompt ids, k)               prompt logprobs (echo), answered
                                                                 between two steps
                     ("close",)                                  stop now
    engine -> HTTP   ("ready", info) | ("failed", kind, text)    once, after building the engine
                                                                 (info: the agents' features
                                                                 the solution has, and why the
                                                                 others are missing)
                     ("accepted", key) | ("refused", key, status, message)
                     ("scored", key, entries)                    a score's logprob entries
                     ("turn", outputs, stats)                    what a step produced (each
                                                                 output's logprobs as entries)
                     ("state", snapshot, stats)                  the live page's view and the
                                                                 counters, at most 20 a second
                     ("failure", keys, message, stats)           a step failed: these requests end

Containment: a request that cannot be added, or a prompt that cannot be scored, is refused alone
(400 when the engine says the input is at fault with a ValueError, else 500); a step that raises
ends the requests in flight with a 500, after the engine has given every page and slot back, and
the loop goes on. If pages are still held after that, the engine's state cannot be trusted: the
process exits with RESTART_STATUS and the HTTP process starts a fresh one. When the HTTP process
goes (even killed), the pipe closes and this process ends at its next turn.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

from . import batch_settings as settings
from . import cli, scheduler_lines, server_features, speculative_settings
from .live_view import MIN_INTERVAL_S, EngineWatch
from .server_ranks import add_op, broadcast, with_seed

RESTART_STATUS = 75  # "start me again": the engine lost track of its pages after a failure


def build_engine(
    args: argparse.Namespace,
    path: Path,
    package: ModuleType,
    draft_path: Path | None = None,
    on_step: Any = None,
    group: Any = None,
) -> tuple:
    """(engine, config) for serve's flags. `draft_path`: the draft model's checkpoint;
    `on_step`: the engine's scheduler events go there (the live page); `group`: the ranks the
    model is sharded over (--tp)."""
    from . import choose_device, load_checkpoint
    from .tokenizer import check_chat_template

    device = choose_device(args.device)
    dtype = args.dtype or cli.default_dtype(device)
    ckpt = load_checkpoint(path, dtype=dtype)  # CheckpointError names the file and problem
    if ckpt.tokenizer is None:
        raise ValueError(f"{path} has no tokenizer.json")
    check_chat_template(ckpt.tokenizer)  # a ChatTemplateError naming the file, before serving
    weight_bytes = sum(w.nbytes for w in ckpt.weights.values())
    problem = settings.check_model(args, ckpt.config, dtype, weight_bytes)
    draft_ckpt = None
    if draft_path is not None and not problem:
        draft_ckpt = load_checkpoint(draft_path, dtype=dtype)
        problem = speculative_settings.check_draft(args, ckpt.config, draft_ckpt.config)
    if problem:
        raise cli.UsageError(problem)
    model = settings.build_model(package, ckpt, args)
    if group is not None:
        model.shard(group)
    pools = settings.make_pools(model, args)
    settings.check_solution(args, pools)  # Week 4 Day 4 missing: stop now, not at a request
    proposer = speculative_settings.make_proposer(package, model, draft_ckpt, args)
    if proposer is not None:  # Week 4 Day 5 missing: the same
        speculative_settings.check_proposer(package, proposer, model, ckpt.tokenizer)
    engine = package.Engine(
        model,
        ckpt.tokenizer,
        pools=pools,
        policy=args.policy,
        on_step=on_step,
        **settings.sizes(args),
        **speculative_settings.engine_keywords(proposer),
    )
    print(f"model: {args.model} ({path}), {device} {dtype}, solution {package.__name__}")
    if group is not None:
        print(f"tensor parallel: {group.size()} ranks, each with 1/{group.size()} of every block")
    print(scheduler_lines.describe(args))
    if args.memory_line:
        print(args.memory_line)
    for hint in cli.cpu_hints(device, dtype):
        print(hint)
    return engine, ckpt.config


def main(conn: Connection, args: argparse.Namespace, path: Path, draft_path: Path | None) -> None:
    """The process's whole life (the target the HTTP process starts). Ctrl-C and SIGTERM are
    the HTTP process's to handle: it closes this one."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    loop = EngineLoop(conn)
    if loop.build(args, path, draft_path):
        sys.exit(loop.serve())


class EngineLoop:
    """The engine, its requests by the HTTP side's keys, and the pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.engine: Any = None
        self.relay: Any = None  # serve --tp: passes each turn's operations to the other ranks
        self.live: dict[int, int] = {}  # engine request id -> the HTTP side's key
        self.watch = EngineWatch()
        self.failures = 0
        self.reported = -math.inf  # when the counters and the page's snapshot went last

    def build(self, args: argparse.Namespace, path: Path, draft_path: Path | None) -> bool:
        """Build the engine and say "ready" (or why not, as the line serve prints)."""
        package = cli.load_solution(args.solution)
        try:
            group = self.join_ranks(args)
            self.engine, config = build_engine(
                args, path, package, draft_path, self.watch.on_step, group
            )
        except NotImplementedError as e:
            hint = scheduler_lines.unfinished_hint(args, e)
            return self.send(
                "failed", "unfinished", cli.unfinished_message(args.solution, e) + hint
            )
        except cli.UsageError as e:
            return self.send("failed", "usage", str(e))
        except (ValueError, OSError) as e:  # CheckpointError is a ValueError
            return self.send("failed", "error", str(e))
        shares_pages = bool(args.prefix_cache and self.engine.pools)
        missing = server_features.probe(package, shares_pages, args.speculative is not None)
        info = {"vocab_size": config.vocab_size, "max_seq_len": args.max_seq_len}
        features = [f for f in server_features.FEATURES if f not in missing]
        self.send("ready", info | {"features": features, "missing": missing})
        return True

    def join_ranks(self, args: argparse.Namespace) -> Any:
        """serve --tp: this process is rank 0 of the group (server_ranks.py)."""
        if args.tp <= 1:
            return None
        from .launch import join_ranks

        group = join_ranks(args.tp)
        self.relay = lambda ops: broadcast(group, ops)
        return group

    def send(self, *message: Any) -> bool:
        sys.stdout.flush()  # what this process printed comes before what the message causes
        try:
            self.conn.send(message)
        except OSError:  # the HTTP process is gone; the next turn notices
            pass
        return False

    # --- the loop ---------------------------------------------------------------------------

    def serve(self) -> int:
        """Commands, then one step, until "close" or the end of the pipe; returns the exit
        status."""
        self.report_turn([], now=True)  # /metrics and the page have the idle engine at once
        while True:
            asked, ops = False, []  # ops: what reached the engine this turn, for other ranks
            scores = []  # run after the relay: a forward pass that every rank takes
            for command in self.commands():
                if command[0] == "close":
                    return self.close()
                if command[0] == "add":
                    ops += self.add(*command[1:])
                elif command[0] == "abort":
                    ops += self.abort(command[1])
                elif command[0] == "score":
                    scores.append(command[1:])
                    ops.append(["score", list(command[2]), command[3]])
                else:  # "watch": a new /events client wants the state now
                    asked = True
            if self.relay is not None and (ops or self.engine.has_work):
                self.relay(ops)
            for key, prompt, k in scores:
                self.score(key, prompt, k)
            outputs = self.step() if self.engine.has_work else []
            if outputs is None:
                return RESTART_STATUS
            self.report_turn(outputs, now=asked or not self.engine.has_work)

    def report_turn(self, outputs: list[tuple], now: bool) -> None:
        """Send a step's outputs at once, with the engine's counters (cheap), then, when due
        (at most MIN_INTERVAL_S apart, or `now`), a snapshot for the live page."""
        stats = {**self.engine.stats(), "engine_failures": self.failures}
        if outputs:
            self.send("turn", outputs, stats)
        if not now and time.monotonic() - self.reported < MIN_INTERVAL_S:
            return
        self.reported = time.monotonic()
        self.send("state", self.watch.publish(self.engine, stats), stats)

    def commands(self) -> list[tuple]:
        """The commands waiting; when the engine has nothing to do, sleep until one comes.
        The pipe's end reads as "close"."""
        taken = []
        try:
            if not self.engine.has_work:
                self.conn.poll(None)
            while self.conn.poll(0):
                taken.append(self.conn.recv())
                if taken[-1][0] == "close":
                    break
        except (EOFError, OSError):
            taken.append(("close",))
        return taken

    def add(self, keys: list[int], prompt: list[int], params: Any) -> list:
        """Add a request, or n answers to one prompt (one key each), all or none; returns the
        operations that reached the engine."""
        if self.relay is not None:
            params = with_seed(params)
        op = [add_op(prompt, params, len(keys))]
        first = getattr(self.engine, "next_id", None)
        try:
            rids = self.engine.add_choices(prompt, params, len(keys))  # n = 1: add_request
        except ValueError as e:  # what only the engine can check; it allocated nothing
            for key in keys:
                self.send("refused", key, 400, str(e))
            return op  # the other ranks' engines refuse it too, and count its ids alike
        except Exception as e:
            report(e, "adding a request")
            for key in keys:
                self.send("refused", key, 500, f"the engine could not add the request: {brief(e)}")
            return op + self.abort_added(first)
        for rid, key in zip(rids, keys):
            self.live[rid] = key
            self.send("accepted", key)
        return op

    def abort_added(self, first: int | None) -> list:
        """After n answers failed half way (a bug: the engine checks everything before it
        queues the first), the ones already queued are aborted: no client waits for them."""
        if first is None:
            return []
        ids = range(first, self.engine.next_id)
        for rid in ids:
            self.engine.abort(rid)  # an id never queued is ignored
        return [["abort", rid] for rid in ids]

    def score(self, key: int, prompt: list[int], k: int) -> None:
        """Score a prompt (Engine.score: a forward pass on a cache of its own, no page or slot
        taken); a failure refuses this one alone."""
        try:
            scored = self.engine.score(prompt, k)
        except ValueError as e:
            self.send("refused", key, 400, str(e))
            return
        except Exception as e:
            report(e, "scoring a prompt")
            self.send("refused", key, 500, f"the engine could not score the prompt: {brief(e)}")
            return
        self.send("scored", key, [None if lp is None else entry(lp) for lp in scored])

    def abort(self, key: int) -> list:
        rid = next((rid for rid, k in self.live.items() if k == key), None)
        if rid is None:  # finished already, or never added
            return []
        self.engine.abort(rid)  # its final output comes with the next step
        self.watch.note("abort", rid)
        return [["abort", rid]]

    def step(self) -> list[tuple] | None:
        """One engine step: each output as a tuple for the pipe, stamped with the time the step
        ended (when its tokens were sampled, as far as the HTTP side can tell). After a failure:
        [] (the requests in flight were failed), or None when the engine must be restarted."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            return self.fail_in_flight(e)
        sampled_at = time.monotonic()
        sent = []
        for o in outputs:
            key = self.live.get(o.request_id)
            if key is None:
                continue
            if o.finish_reason is not None:
                del self.live[o.request_id]
            logprobs = getattr(o, "logprobs", None)
            sent.append(
                (key, o.text, o.token_ids, o.finish_reason, o.prompt_tokens,
                 o.completion_tokens, getattr(o, "cached_tokens", 0), sampled_at,
                 None if logprobs is None else [entry(lp) for lp in logprobs])
            )  # fmt: skip
        return sent

    def fail_in_flight(self, error: Exception) -> list | None:
        """A step raised: the engine cannot say which request caused it, so every request in
        flight ends with a 500, and every page and slot goes back."""
        report(error, "a step")
        self.failures += 1
        self.engine.release()  # Engine.step released already, unless collecting raised
        message = f"the engine failed in a step and ended this request: {brief(error)}"
        stats = {**self.engine.stats(), "engine_failures": self.failures}
        self.send("failure", list(self.live.values()), message, stats)
        self.live.clear()
        self.watch.note("failure", None, detail=brief(error))
        if self.engine.stats().get("pages_in_use"):
            print("error: pages still in use after a failed step: restarting the engine",
                  file=sys.stderr, flush=True)  # fmt: skip
            return None
        return []

    def close(self) -> int:
        """Stop: the HTTP side has ended every request already; the other ranks stop too."""
        if self.relay is not None:
            self.relay([["close"]])
        self.engine.release()
        return 0


def entry(logprob: Any) -> tuple:
    """A TokenLogprob as plain values for the pipe (server_formats.Entry)."""
    return (logprob.token, logprob.logprob, tuple(logprob.top))


def brief(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def report(error: Exception, where: str) -> None:
    """The traceback on the server's stderr (one line for an exercise not written yet)."""
    if not isinstance(error, NotImplementedError):
        traceback.print_exc()
    print(f"error: the engine failed in {where}: {brief(error)}", file=sys.stderr, flush=True)

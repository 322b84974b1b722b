"""An OpenAI-compatible server around the course's engine (Week 4 Day 3).

    pdm run serve [--model tiny|qwen3-0.6b|PATH] [--port 8000] [--solution ref|tiny_llm] ...

Then any OpenAI client talks to it, e.g. with the `openai` package:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])

and a browser at http://127.0.0.1:8000/ shows a chat box beside the engine as it runs (its slots,
queue, forward passes and page pool, from the server-sent events of GET /events).

The engine runs in a process of its own, which loads the model and steps the engine
(tiny_llm_support.engine_process); this process serves HTTP and talks to it over a pipe
(tiny_llm_support.server_engine), so no request can stop the server: a failure inside the engine
fails the requests it touched, and an engine process that dies is started again. The endpoints
and the wire format: tiny_llm_support.server, server_api and server_replies.

It serves with the course's fastest design by default, not batch-main's teaching defaults: the
hybrid policy (Week 3 Day 4), a paged pool read in place (Week 3 Day 5) with the prefix cache
(Week 4 Day 4), 8 slots, and the pool and context sized from memory (tiny_llm_support.kv_memory:
--memory-fraction of what MLX may use, less the weights; the start-up line says what that came
to). --policy alternate, --gather, --no-prefix-cache, --dense, --max-pages and --max-seq-len take
each part back. Speculative decoding (Week 4 Day 5), as in batch-main: --speculative ngram
(prompt lookup) or --speculative MODEL (a draft model, named as for --model), --num-draft-tokens
K guesses (default 4). Ctrl-C or SIGTERM stop it: requests in flight get an error, then it exits
(130 after Ctrl-C, else 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from tiny_llm_support import ModelNotAvailableError, cli
from tiny_llm_support import batch_settings as settings
from tiny_llm_support.engine_pipe import EngineStartError
from tiny_llm_support.engine_process import build_engine
from tiny_llm_support.launch import in_ranks, join_ranks, relaunch_as_ranks
from tiny_llm_support.server import OpenAIServer, ServerSettings
from tiny_llm_support.server_engine import EngineClient
from tiny_llm_support.server_ranks import follow
from tiny_llm_support.server_run import listen, serve
from tiny_llm_support.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.script_parser(
        "serve", "An OpenAI-compatible server (/v1/chat/completions, /v1/completions)."
    )
    p.set_defaults(linear_kernel="auto")  # the fastest design by default, as for the engine
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (another one: set --api-key)"
    )
    p.add_argument("--port", type=cli.int_at_least(0), default=8000, help="0: any free port")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (401; default: none)",
    )
    p.add_argument(
        "--max-waiting",
        type=cli.int_at_least(0),
        default=None,
        help="refuse (429, Retry-After) a request that would make more than this many wait for "
        "a decode slot (default: no limit)",
    )
    cli.add_engine_arguments(p, serving=True)
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("TINY_LLM_CACHE"),
        help="where the tiny-random checkpoint is made (default: $TINY_LLM_CACHE or "
        "~/.cache/tiny-llm); downloaded models live in the Hugging Face cache ($HF_HOME)",
    )
    settings.add_arguments(p, serving=True)
    args = p.parse_args(argv)
    if args.port > 65535:
        p.error("--port is at most 65535")
    problem = cli.ranks_problem(args.tp, args.hostfile) or settings.check_arguments(
        args, serving=True
    )
    if problem:
        p.error(problem)
    return args


def run(args: argparse.Namespace) -> int:
    try:
        path, draft_path = settings.checkpoint_paths(args)
    except ModelNotAvailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.tp > 1:
        if not in_ranks():  # each rank runs this command again; rank 0 serves
            return relaunch_as_ranks(path, args.tp, args.hostfile)
        if int(os.environ[startup.RANK_ENV]) != 0:
            return follow_rank_0(args, path, draft_path)
        # rank 0: its engine process joins the ranks (it inherits this process's environment)
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    service = EngineClient(args, path, draft_path, args.max_waiting)
    try:
        info = service.start()
    except EngineStartError as e:
        sock.close()
        if e.kind == "usage":
            raise cli.UsageError(str(e)) from None
        print(str(e) if e.kind == "unfinished" else f"error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        sock.close()
        raise
    served = ServerSettings(
        model_id=args.model,
        max_seq_len=info["max_seq_len"],
        vocab_size=info["vocab_size"],
        api_key=args.api_key,
    )
    package = cli.load_solution(args.solution)  # its SamplingParams check requests at the edge
    app = OpenAIServer(service, load_tokenizer(path), package.SamplingParams, served).app()
    host, port = sock.getsockname()[:2]
    print(f"serving '{args.model}' at http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    print(f"the engine, live: http://{host}:{port}/", flush=True)
    try:
        server = serve(app, sock, service)
    finally:
        service.join(timeout=10)
    return exit_status(server.stop_signal, service.error)


def follow_rank_0(args: argparse.Namespace, path, draft_path) -> int:
    """A rank other than 0 of serve --tp: the same engine over its share of the model, doing
    what rank 0's engine process tells it each turn (server_ranks.py), until rank 0 closes."""
    group = join_ranks(args.tp)
    package = cli.load_solution(args.solution)
    engine, _ = build_engine(args, path, package, draft_path, group=group)
    follow(engine, group, package.SamplingParams)
    return 0


def exit_status(stop_signal: int | None, error: str | None) -> int:
    """130 after Ctrl-C (as every command of the course), 0 after SIGTERM, 1 when the engine
    is gone for good."""
    if error is not None:
        return 1
    if stop_signal == signal.SIGINT:
        print("interrupted", file=sys.stderr, flush=True)
        return startup.INTERRUPTED
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(parse_args, run, argv)


if __name__ == "__main__":
    cli.run_script(main)

"""An OpenAI-compatible server around the course's engine (Week 4 Day 3).

    pdm run serve [--model tiny|qwen3-0.6b|PATH] [--port 8000] [--solution ref|tiny_llm] ...

Then any OpenAI client talks to it, e.g. with the `openai` package:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])

and a browser at http://127.0.0.1:8000/ shows a chat box beside the engine as it runs (its slots,
queue, forward passes and page pool, from the server-sent events of GET /events).

One thread loads the model and steps the engine; the HTTP handlers only queue work for it
(tiny_llm_support.server_engine). The endpoints and the wire format: tiny_llm_support.server and
server_api. The scheduler flags are batch-main's (tiny_llm_support.batch_settings), except that
the prefix cache (Week 4 Day 4) is on by default here whenever the pool is bounded (--max-pages);
--no-prefix-cache turns it off. Speculative decoding (Week 4 Day 5), as in batch-main:
--speculative ngram (prompt lookup) or --speculative MODEL (a draft model, named as for --model),
--num-draft-tokens K guesses (default 4); the hybrid policy unless --policy alternate. Ctrl-C or SIGTERM stop it:
requests in flight get an error, then it exits (130 after Ctrl-C, else 0).
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
from tiny_llm_support import ModelNotAvailableError, choose_device, cli, load_checkpoint
from tiny_llm_support import batch_settings as settings
from tiny_llm_support.launch import in_ranks, join_ranks, relaunch_as_ranks
from tiny_llm_support.server import OpenAIServer, ServerSettings
from tiny_llm_support.server_engine import EngineService
from tiny_llm_support.server_ranks import broadcast, follow
from tiny_llm_support.server_run import listen, serve
from tiny_llm_support.tokenizer import check_chat_template


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.script_parser(
        "serve", "An OpenAI-compatible server (/v1/chat/completions, /v1/completions)."
    )
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
    cli.add_engine_arguments(p)
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


def build_engine(
    args: argparse.Namespace, path, package, draft_path=None, on_step=None, group=None
) -> tuple:
    """(engine, tokenizer, config): runs on the engine thread, which owns MLX from the first
    array on, the model's weights included. `draft_path`: the draft model's checkpoint;
    `on_step`: the engine's scheduler events go there (the live page); `group`: the ranks the
    model is sharded over (--tp)."""
    device = choose_device(args.device)
    dtype = args.dtype or cli.default_dtype(device)
    ckpt = load_checkpoint(path, dtype=dtype)  # CheckpointError names the file and problem
    if ckpt.tokenizer is None:
        raise ValueError(f"{path} has no tokenizer.json")
    check_chat_template(ckpt.tokenizer)  # a ChatTemplateError naming the file, before serving
    problem = settings.check_model(args, ckpt.config, dtype)
    draft_ckpt = None
    if draft_path is not None and not problem:
        draft_ckpt = load_checkpoint(draft_path, dtype=dtype)
        problem = settings.check_draft(args, ckpt.config, draft_ckpt.config)
    if problem:
        raise cli.UsageError(problem)
    model = settings.build_model(package, ckpt, args)
    if group is not None:
        model.shard(group)
    pools = settings.make_pools(model, args)
    settings.check_solution(args, pools)  # Week 4 Day 4 missing: stop now, not at a request
    proposer = settings.make_proposer(package, model, draft_ckpt, args)
    if proposer is not None:  # Week 4 Day 5 missing: the same
        settings.check_proposer(package, proposer, model, ckpt.tokenizer)
    engine = package.Engine(
        model,
        ckpt.tokenizer,
        pools=pools,
        policy=args.policy,
        on_step=on_step,
        **settings.sizes(args),
        **settings.engine_keywords(proposer),
    )
    print(f"model: {args.model} ({path}), {device} {dtype}, solution {package.__name__}")
    if group is not None:
        print(f"tensor parallel: {group.size()} ranks, each with 1/{group.size()} of every block")
    print(settings.describe(args))
    for hint in cli.cpu_hints(device, dtype):
        print(hint)
    return engine, ckpt.tokenizer, ckpt.config


def run(args: argparse.Namespace) -> int:
    try:
        path, draft_path = settings.checkpoint_paths(args)
    except ModelNotAvailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    group = None
    if args.tp > 1:
        if not in_ranks():  # each rank runs this command again; rank 0 serves
            return relaunch_as_ranks(path, args.tp, args.hostfile)
        group = join_ranks(args.tp)
        if group.rank() != 0:
            return follow_rank_0(args, path, draft_path, group)
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    package = cli.load_solution(args.solution)
    loaded = {}  # what build() leaves for this thread besides the engine

    def build(on_step):
        engine, loaded["tokenizer"], loaded["config"] = build_engine(
            args, path, package, draft_path, on_step, group
        )
        return engine

    relay = None if group is None else lambda ops: broadcast(group, ops)
    service = EngineService(build, args.batch_size, args.max_waiting, relay=relay)
    try:
        service.start()
    except NotImplementedError as e:
        hint = settings.unfinished_hint(args, e)
        print(cli.unfinished_message(args.solution, e) + hint, file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if service.error is not None:  # it failed to start: nothing will be served
            sock.close()
    served = ServerSettings(
        model_id=args.model,
        max_seq_len=args.max_seq_len,
        vocab_size=loaded["config"].vocab_size,
        api_key=args.api_key,
    )
    app = OpenAIServer(service, loaded["tokenizer"], package.SamplingParams, served).app()
    host, port = sock.getsockname()[:2]
    print(f"serving '{args.model}' at http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    print(f"the engine, live: http://{host}:{port}/", flush=True)
    server = serve(app, sock, service)
    service.close()
    service.join(timeout=10)
    return exit_status(server.stop_signal, service.error)


def follow_rank_0(args: argparse.Namespace, path, draft_path, group) -> int:
    """A rank other than 0 of serve --tp: the same engine over its share of the model, doing
    what rank 0 tells it each turn (server_ranks.py), until rank 0 closes."""
    package = cli.load_solution(args.solution)
    engine, _, _ = build_engine(args, path, package, draft_path, group=group)
    follow(engine, group, package.SamplingParams)
    return 0


def exit_status(stop_signal: int | None, error: BaseException | None) -> int:
    """130 after Ctrl-C (as every command of the course), 0 after SIGTERM, 1 when the engine
    failed."""
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

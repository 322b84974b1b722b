"""Generate text for one prompt with the course's Qwen3 engine.

    pdm run main --prompt "What is a KV cache?"          # the tiny model, offline
    pdm run main --model qwen3-0.6b --prompt "Explain paged attention in two sentences." \
        --solution tiny_llm                               # real weights, your code

`--solution tiny_llm` runs your code. It uses Week 2's cached loop (Qwen3Model with
simple_generate_with_kv_cache) once that is written, and Week 1's loop (Qwen3ModelWeek1 with
simple_generate, which recomputes the whole sequence every step) before that. The `tiny`
model is a small chat model trained in the project and shipped in the package: it runs offline
and answers the demo's questions and a few more (data/tiny-chat/qa.txt lists them), and little
else. `tiny-random` has random weights.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from tiny_llm_support import ModelNotAvailableError, choose_device, cli, load_checkpoint
from tiny_llm_support.checkpoint_files import CheckpointError
from tiny_llm_support.launch import in_ranks, join_ranks, relaunch_as_ranks
from tiny_llm_support.tokenizer import check_chat_text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.script_parser("main", "Generate text for one prompt.")
    p.add_argument(
        "--prompt",
        type=cli.text,
        default="Write a haiku about a cat.",
        help="the user's message (the tiny model answers the questions of data/tiny-chat/qa.txt)",
    )
    p.add_argument("--max-tokens", type=cli.int_at_least(0), default=64, help="tokens to generate")
    p.add_argument("--temperature", type=cli.float_at_least(0), default=0.0, help="0 is greedy")
    p.add_argument(
        "--top-k",
        type=cli.int_at_least(1),
        default=None,
        help="sample among the k likeliest tokens (default: all)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample among the likeliest tokens that make up this share (default: all)",
    )
    p.add_argument(
        "--seed",
        type=cli.int_between(0, 2**64 - 1),  # what mx.random.key takes
        default=None,
        help="makes sampling reproducible (default: a new draw every run)",
    )
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    args = p.parse_args(argv)
    problem = cli.ranks_problem(args.tp, args.hostfile)
    if problem:
        p.error(problem)
    if args.tp > 1 and args.temperature > 0 and args.seed is None:
        p.error("--tp with --temperature > 0 needs --seed: every rank must sample the same token")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    return args


def start(package, ckpt, prompt_tokens: list[int], sampler, max_tokens: int, group=None,
          options=None):  # fmt: skip
    """(name of the loop, token iterator): the cached loop if it is written, else Week 1's.
    options: Qwen3Model's keywords (cli.model_options)."""
    eos = ckpt.tokenizer.eos_token_ids
    options = options or {}
    path = {k: v for k, v in options.items() if k == "quantized_linear"}  # Week 1's model's too
    try:
        model = package.Qwen3Model(ckpt, **options)
        if group is not None:
            model.shard(group)  # tensor parallelism: Week 4 Day 2
        stream = package.simple_generate_with_kv_cache(
            model, prompt_tokens, max_tokens, sampler, eos
        )
        first = next(stream, None)  # runs the prefill, or raises if Week 2 is not written yet
        return "Qwen3Model + simple_generate_with_kv_cache", itertools.chain(
            [] if first is None else [first], stream
        )
    except NotImplementedError:
        if group is not None:
            raise  # Week 1's loop has no sharded model
        model = package.Qwen3ModelWeek1(ckpt, **path)
        loop = package.simple_generate(model, prompt_tokens, max_tokens, sampler, eos)
        return "Qwen3ModelWeek1 + simple_generate (no KV cache yet)", loop


def encode_prompt(ckpt, prompt: str, chat_template: bool) -> list[int]:
    """The prompt's token ids; ValueError for an empty prompt (or one of only whitespace,
    through the chat template), for one longer than the model's positions, and for a chat
    template that fails (ChatTemplateError), before any model call."""
    text = prompt
    if chat_template:
        messages = [{"role": "user", "content": prompt}]
        check_chat_text(messages)
        text = ckpt.tokenizer.apply_chat_template(messages)
    tokens = ckpt.tokenizer.encode(text)
    limit = ckpt.config.max_position_embeddings
    if not tokens:
        raise ValueError("the prompt is empty: it has no tokens to start from")
    if len(tokens) > limit:
        raise ValueError(
            f"the prompt has {len(tokens)} tokens, more than the model's {limit} positions "
            "(max_position_embeddings in its config.json)"
        )
    return tokens


def run(args: argparse.Namespace) -> int:
    package = cli.load_solution(args.solution)
    try:
        device = choose_device(args.device)
        dtype = cli.default_dtype(device)
        path = cli.model_path(args.model)
        if args.tp > 1 and not in_ranks():  # each rank runs this command again
            return relaunch_as_ranks(path, args.tp, args.hostfile)
        group = join_ranks(args.tp) if args.tp > 1 else None  # from here on only rank 0 prints
        ckpt = load_checkpoint(path, dtype=dtype)
        if ckpt.tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json")
        prompt_tokens = encode_prompt(ckpt, args.prompt, not args.no_chat_template)
    except (CheckpointError, ValueError, OSError, ModelNotAvailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = ckpt.tokenizer
    # n new tokens take positions up to len(prompt) + n - 2 (the last one is never fed back)
    limit = ckpt.config.max_position_embeddings
    max_tokens = min(args.max_tokens, limit - len(prompt_tokens) + 1)
    print(f"model: {args.model} ({path}), {device} {dtype}, solution {package.__name__}")
    if group is not None:
        print(f"tensor parallel: {group.size()} ranks, each with 1/{group.size()} of every block")
    if cli.model_note(args.model):
        print(cli.model_note(args.model))
    for hint in cli.cpu_hints(device, dtype):
        print(hint)

    t0 = time.perf_counter()
    try:
        sampler = package.make_sampler(args.temperature, args.top_k, args.top_p, args.seed)
        options = cli.model_options(package, args)
        loop, stream = start(package, ckpt, prompt_tokens, sampler, max_tokens, group, options)
        print(f"loop: {loop}; prompt: {len(prompt_tokens)} tokens\n")
        detok, n, t_first = tokenizer.detokenizer(), 0, None
        stop = "max tokens" if max_tokens == args.max_tokens else f"the {limit}-position limit"
        for token in stream:
            n += 1
            t_first = t_first or time.perf_counter()
            if token in tokenizer.eos_token_ids:
                stop = "eos"
                break
            print(cli.printable(detok.add_token(token)), end="", flush=True)
        print(cli.printable(detok.finalize()))
    except NotImplementedError as e:
        print(cli.unfinished_message(args.solution, e), file=sys.stderr)
        return 1
    total = time.perf_counter() - t0
    rate = (n - 1) / (total - (t_first - t0)) if n > 1 else 0.0
    first = f", first after {t_first - t0:.2f} s" if t_first else ""
    print(f"\n[{n} tokens in {total:.2f} s{first}, then {rate:.1f} tokens/s; stopped at {stop}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(parse_args, run, argv)


if __name__ == "__main__":
    cli.run_script(main)

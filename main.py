"""Generate text for one prompt with the course's Qwen3 engine.

    pdm run main --model tiny --prompt "Tell me a story."
    pdm run main --model qwen3-0.6b --prompt "What is a KV cache?" --solution tiny_llm

`--solution tiny_llm` runs your code. It uses Week 2's cached loop (Qwen3Model with
simple_generate_with_kv_cache) once that is written, and Week 1's loop (Qwen3ModelWeek1 with
simple_generate, which recomputes the whole sequence every step) before that. The `tiny`
model is a small chat model trained in the project and shipped in the package: it runs offline
and knows little beyond the demo's questions. `tiny-random` has random weights.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import time

SOLUTIONS = {"ref": "tiny_llm_ref", "tiny_llm": "tiny_llm"}
# a random model writes any byte; print control characters (escape codes...) as U+FFFD
CONTROLS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="main",
        description="Generate text for one prompt.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny (trained, shipped), tiny-random, a shortcut (qwen3-0.6b), org/name or a path",
    )
    p.add_argument("--solution", choices=sorted(SOLUTIONS), default="ref", help="tiny_llm is yours")
    p.add_argument("--prompt", default="Tell me a short story about a cat.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (mlx.launch)")
    p.add_argument("--hostfile", help="with --tp: an mlx.launch hostfile (several machines)")
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if args.tp > 1 and args.temperature > 0 and args.seed is None:
        p.error("--tp with --temperature > 0 needs --seed: every rank must sample the same token")
    if args.max_tokens < 0 or args.temperature < 0:
        p.error("--max-tokens and --temperature must be >= 0")
    if args.top_k is not None and args.top_k < 1:
        p.error("--top-k must be >= 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    return args


def start(package, ckpt, prompt_tokens: list[int], sampler, max_tokens: int, group=None):
    """(name of the loop, token iterator): the cached loop if it is written, else Week 1's."""
    eos = ckpt.tokenizer.eos_token_ids
    try:
        model = package.Qwen3Model(ckpt)
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
        model = package.Qwen3ModelWeek1(ckpt)
        loop = package.simple_generate(model, prompt_tokens, max_tokens, sampler, eos)
        return "Qwen3ModelWeek1 + simple_generate (no KV cache yet)", loop


def run(args: argparse.Namespace) -> int:
    from tiny_llm_support import (
        OPENBLAS_HINT,
        ModelNotAvailableError,
        blas_info,
        choose_device,
        load_checkpoint,
        resolve_model,
    )
    from tiny_llm_support.launch import in_ranks, join_ranks, relaunch_as_ranks

    package = importlib.import_module(SOLUTIONS[args.solution])
    try:
        device = choose_device(args.device)
        dtype = "float32" if device == "cpu" else "bfloat16"  # bf16 matmul is slow on the CPU
        path = resolve_model(args.model)
        if args.tp > 1 and not in_ranks():
            return relaunch_as_ranks(args.tp, args.hostfile)  # each rank runs this command again
        group = join_ranks(args.tp) if args.tp > 1 else None  # from here on only rank 0 prints
        ckpt = load_checkpoint(path, dtype=dtype)
        if ckpt.tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json")
    except (ValueError, OSError, ModelNotAvailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = ckpt.tokenizer

    text = args.prompt
    if not args.no_chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    prompt_tokens = tokenizer.encode(text)
    print(f"model: {args.model} ({path}), {device} {dtype}, solution {package.__name__}")
    if args.model == "tiny-random":
        print("note: 'tiny-random' has random weights, so its text is meaningless")
    elif args.model == "tiny":
        print("note: 'tiny' knows little beyond the demo's questions; try --model qwen3-0.6b")
    if device == "cpu" and blas_info()["blas"].startswith("reference"):
        print(f"hint: {OPENBLAS_HINT}")

    t0 = time.perf_counter()
    try:
        sampler = package.make_sampler(args.temperature, args.top_k, args.top_p, args.seed)
        loop, stream = start(package, ckpt, prompt_tokens, sampler, args.max_tokens, group)
        print(f"loop: {loop}; prompt: {len(prompt_tokens)} tokens\n")
        detok, n, t_first, stop = tokenizer.detokenizer(), 0, None, "max tokens"
        for token in stream:
            n += 1
            t_first = t_first or time.perf_counter()
            if token in tokenizer.eos_token_ids:
                stop = "eos"
                break
            print(detok.add_token(token).translate(CONTROLS), end="", flush=True)
        print(detok.finalize().translate(CONTROLS))
    except NotImplementedError as e:
        print(
            f"error: {package.__name__} is not finished: {e} (or use --solution ref)",
            file=sys.stderr,
        )
        return 1
    total = time.perf_counter() - t0
    rate = (n - 1) / (total - (t_first - t0)) if n > 1 else 0.0
    first = f", first after {t_first - t0:.2f} s" if t_first else ""
    print(f"\n[{n} tokens in {total:.2f} s{first}, then {rate:.1f} tokens/s; stopped at {stop}]")
    return 0


if __name__ == "__main__":
    arguments = parse_args()
    from tiny_llm_support import reexec_with_openblas

    reexec_with_openblas()
    sys.exit(run(arguments))

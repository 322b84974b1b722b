"""Continuous-batching demo: a batch of chat prompts through batch_generate, drawn live.

    pdm run batch-main [--model tiny|qwen3-0.6b|PATH] [--solution ref|tiny_llm] ...

The default model, `tiny`, is a small chat model trained in the project and shipped in the
package (no network); `tiny-random` has random weights. Shortcuts such as `qwen3-0.6b` are
fetched into the Hugging Face cache. On a terminal the slots and prefills are drawn live with
rich; otherwise a line is printed per prefill chunk, per finished request and per `--log-every`
decode steps. Then come the answers and the measurements. The scheduler settings of Week 3
(--compile, --policy, --max-pages, --gather), the prefix cache of Week 4 Day 4 (--prefix-cache,
off unless asked for) and speculative decoding of Week 4 Day 5 (--speculative ngram|MODEL,
--num-draft-tokens K; hybrid unless --policy alternate): tiny_llm_support.batch_settings and
speculative_settings, the lines about them scheduler_lines; views: batch_views; measurements:
batch_recorder; prompts: demo_prompts.
"""

from __future__ import annotations

import argparse
import os
import sys

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from tiny_llm_support import (
    ModelNotAvailableError,
    blas_info,
    choose_device,
    cli,
    load_checkpoint,
    scheduler_lines,
    speculative_settings,
)
from tiny_llm_support import batch_settings as settings
from tiny_llm_support import batch_views as views
from tiny_llm_support.batch_recorder import BatchRecorder, StepError
from tiny_llm_support.checkpoint_files import CheckpointError
from tiny_llm_support.demo_prompts import DEMO_PROMPTS, MIN_ANSWER_TOKENS, prepare_prompts
from tiny_llm_support.launch import in_ranks, join_ranks, relaunch_as_ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    positive = cli.int_at_least(1)
    p = cli.script_parser("batch-main", "Continuous batching with chunked prefill, drawn live.")
    cli.add_engine_arguments(p)
    p.add_argument(
        "--enable-thinking", action="store_true", help="let Qwen3 think (<think>...</think>)"
    )
    p.add_argument("--seed", type=int, default=0, help="shuffles the prompts")
    p.add_argument(
        "--num-prompts",
        type=positive,
        default=len(DEMO_PROMPTS),
        help=f"how many of the {len(DEMO_PROMPTS)} demo prompts to run",
    )
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("TINY_LLM_CACHE"),
        help="where the tiny checkpoint is made (default: $TINY_LLM_CACHE or ~/.cache/tiny-llm); "
        "downloaded models live in the Hugging Face cache ($HF_HOME)",
    )
    p.add_argument(
        "--log-every", type=positive, default=16, help="without a terminal: every Nth decode step"
    )
    p.add_argument("--plain", action="store_true", help="line output even on a terminal")
    settings.add_arguments(p)
    args = p.parse_args(argv)
    if args.max_seq_len <= MIN_ANSWER_TOKENS:
        p.error(f"--max-seq-len must be more than {MIN_ANSWER_TOKENS}")
    if args.num_prompts > len(DEMO_PROMPTS):
        p.error(f"--num-prompts is at most {len(DEMO_PROMPTS)}")
    args.batch_size = min(args.batch_size, args.num_prompts)  # more slots would stay empty
    problem = cli.ranks_problem(args.tp, args.hostfile) or settings.check_arguments(args)
    if problem:
        p.error(problem)
    return args


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(highlight=False, markup=False)  # model text may contain [brackets]
    live = console.is_terminal and not args.plain
    out = console.print if live else (lambda s: print(s, flush=True))
    try:
        device = choose_device(args.device)
    except ValueError as e:
        raise cli.UsageError(str(e)) from e
    dtype = args.dtype or cli.default_dtype(device)
    try:
        path, draft_path = settings.checkpoint_paths(args)
    except ModelNotAvailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if args.tp > 1 and not in_ranks():  # each rank runs this command again
            return relaunch_as_ranks(path, args.tp, args.hostfile)
        group = join_ranks(args.tp) if args.tp > 1 else None  # from here on only rank 0 prints
        ckpt = load_checkpoint(path, dtype=dtype)  # CheckpointError names the file and problem
        if ckpt.tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json")
        draft_ckpt = load_checkpoint(draft_path, dtype=dtype) if draft_path else None
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = ckpt.tokenizer
    problem = settings.check_model(args, ckpt.config, dtype)
    if draft_ckpt is not None and not problem:
        problem = speculative_settings.check_draft(args, ckpt.config, draft_ckpt.config)
    if problem:
        raise cli.UsageError(problem)
    try:
        chosen = prepare_prompts(
            tokenizer, args.seed, args.num_prompts, args.max_seq_len, args.enable_thinking
        )
    except CheckpointError as e:  # a chat template that fails: it names its file
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        raise cli.UsageError(str(e)) from e
    package = cli.load_solution(args.solution)

    c = ckpt.config
    out(
        f"model: {args.model} ({path}): {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} query / {c.num_key_value_heads} KV heads"
    )
    if cli.model_note(args.model):
        out(cli.model_note(args.model))
    out(
        f"solution: {package.__name__}   device: {device} {dtype}   batch size {args.batch_size}"
        f"   prefill step {args.prefill_step}   max seq len {args.max_seq_len}"
    )
    out(scheduler_lines.describe(args))
    shared = sum(1 for p in chosen.prompts if p.context)
    out(
        f"{len(chosen.prompts)} prompts (seed {args.seed}), {shared} sharing the Harrowfield "
        f"paragraph; prompt tokens {min(chosen.lengths)}..{max(chosen.lengths)}"
    )
    for prompt, n in chosen.skipped:
        out(
            f"skipped ({n} tokens, does not fit --max-seq-len {args.max_seq_len}): {prompt.label()}"
        )
    if device == "cpu":
        out(f"blas: {blas_info()['blas']}")
    for hint in cli.cpu_hints(device, dtype):
        out(hint)

    title = f"batch-main: {args.model} on {package.__name__}, {device} {dtype}"
    n = len(chosen.prompts)
    try:
        model = settings.build_model(package, ckpt, args)
        if group is not None:
            model.shard(group)
            out(f"tensor parallel: {group.size()} ranks, each with 1/{group.size()} of every block")
        pools = settings.make_pools(model, args)
        try:
            proposer = speculative_settings.make_proposer(package, model, draft_ckpt, args)
        except ValueError as e:  # a copy of the course from before Week 4 Day 5
            raise cli.UsageError(str(e)) from e
        view = (
            views.LiveView(console, title, n, args.batch_size, pools)
            if live
            else views.PlainView(args.log_every)
        )
        rec = BatchRecorder()  # the requests arrive once the model is built
        cached = [0]  # prompt tokens the admissions found in the prefix cache

        def on_step(step) -> None:
            if step.kind == "admit":
                cached[0] += step.tokens
            rec.on_step(step)
            with rec.paused():  # drawing is left out of every measurement
                view.show(step, rec)

        with view:
            results = package.batch_generate(
                model,
                tokenizer,
                chosen.texts,
                on_step=on_step,
                **settings.sizes(args),
                **settings.batch_keywords(args, pools, proposer),
            )
        rec.stop()
    except NotImplementedError as e:
        hint = scheduler_lines.unfinished_hint(args, e, "batch-main")
        print(cli.unfinished_message(args.solution, e) + hint, file=sys.stderr)
        return 1
    except StepError as e:
        print(f"error: {package.__name__}.batch_generate: {e}", file=sys.stderr)
        return 1

    texts = dict(results)
    answers = [views.answer_text(texts.get(i, ""), tokenizer) for i in range(n)]
    views.print_answers(
        out, [p.label() for p in chosen.prompts], answers, console if live else None
    )
    views.print_summary(out, rec, console if live else None)
    for line in scheduler_lines.summary_lines(model, pools, cached[0], proposer):
        out(line)
    if args.model == "tiny-random":
        out("(tiny-random: random weights, so the answers above are meaningless by design)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(parse_args, run, argv)


if __name__ == "__main__":
    cli.run_script(main)

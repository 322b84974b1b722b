"""How batch-main and serve run the scheduler: the settings of Week 3 Days 3 to 6 and Week 4
Days 4 and 5, from the command line to the model, the page pools and batch_generate's keywords.
Speculative decoding's own pieces are in speculative_settings.py, the lines that describe the
settings in scheduler_lines.py.

    --compile             the blocks' token-parallel halves compiled (3.3); query padding on
    --policy hybrid       one forward pass per iteration: decode rows and prompt chunks (3.4)
    --max-pages N         a bounded paged KV pool (3.6), pages of --page-size tokens (2.2)
    --gather              read the pages by gathering them (2.2) instead of in place (3.5)
    --prefix-cache        full pages shared by content between prompts (4.4)
    --speculative ngram|PATH, --num-draft-tokens K
                          guesses checked in the decode pass (4.5)

batch-main keeps the teaching defaults its chapters run: the alternate policy, dense caches,
no prefix cache, each turned on by its flag. serve starts from the course's fastest design
instead: the hybrid policy, a paged pool read in place with the prefix cache, the pool sized
from memory (kv_memory); --dense, --gather, --no-prefix-cache and --policy alternate take each
part back. Its pool is always bounded, which the prefix cache needs: a cached page leaves the
cache only when an allocation finds no free page.

Every check here runs before any model call; a setting a solution has not written yet stops
with its task message when batch_generate reaches it (serve looks for the prefix cache's first
task and for each of speculative decoding's tasks at start-up, see check_solution and
speculative_settings.check_proposer).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import kv_memory
from .cli import UsageError, int_at_least, model_options, model_path
from .speculative_settings import (
    add_speculative_arguments,
    check_speculative_arguments,
    draft_path,
    engine_keywords,
)

POLICIES = ("alternate", "hybrid")
DEFAULT_PAGE_SIZE = 16


def add_arguments(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """--compile, --policy, --max-pages, --page-size, --read-in-place / --gather,
    --prefix-cache / --no-prefix-cache, --speculative and --num-draft-tokens; `serving`: serve's
    defaults (see check_arguments) and its --dense and --memory-fraction."""
    g = p.add_argument_group("scheduler (Week 3 Days 3-6, Week 4 Day 4)")
    policy = "hybrid" if serving else "alternate, hybrid with --speculative"
    pages = "from --memory-fraction" if serving else "none: dense caches"
    g.add_argument(
        "--compile",
        action="store_true",
        help="compile the blocks' token-parallel halves (3.3); chunks are padded to a ladder",
    )
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,  # until check_arguments knows whether --speculative asks for hybrid
        help="alternate: a prefill chunk, then a decode pass; hybrid: one pass holding every "
        f"decode row and prompt chunks, --prefill-step rows in all (3.4); default: {policy}",
    )
    g.add_argument(
        "--max-pages",
        type=int_at_least(1),
        default=None,
        help="serve from a paged KV pool of this many pages per layer: too few for every "
        f"request at once means waits and preemptions (3.6; default: {pages})",
    )
    g.add_argument(
        "--page-size",
        type=int_at_least(1),
        default=None,
        help=f"tokens per page (default {DEFAULT_PAGE_SIZE})"
        + ("" if serving else "; alone: an unbounded paged pool"),
    )
    read = g.add_mutually_exclusive_group()
    read.add_argument(
        "--read-in-place",
        dest="read_in_place",
        action="store_true",
        default=None,
        help="attention reads the pages where they lie (3.5; the default with pages)",
    )
    read.add_argument(
        "--gather",
        dest="read_in_place",
        action="store_false",
        help="attention reads a dense copy gathered from the pages (2.2)",
    )
    default = "default: on unless --dense" if serving else "default: off"
    g.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV pages of full prompt blocks by content, so a prompt that starts like "
        f"an earlier one skips that part of its prefill (4.4; needs pages; {default})",
    )
    if serving:
        kv_memory.add_arguments(g)
    add_speculative_arguments(p)


def check_arguments(args: argparse.Namespace, serving: bool = False) -> str | None:
    """What is wrong with the settings on their own, or None; fills in the defaults. `serving`
    (serve): pages, the prefix cache and the hybrid policy unless --dense or --policy say
    otherwise; the sizes that depend on the model come later (check_model)."""
    if serving and args.dense:
        given = [flag for flag, on in page_flags(args) if on]
        if given:
            return f"{given[0]} is about KV pages, and --dense asks for dense caches: drop one"
    sized = args.max_pages is not None or args.page_size is not None
    paged = sized or (serving and not args.dense)  # serve's pages unless --dense
    if args.read_in_place is not None and not paged:
        flag = "--read-in-place" if args.read_in_place else "--gather"
        return f"{flag} is about reading KV pages: add --max-pages N (or --page-size N)"
    if args.prefix_cache and not paged:
        return (
            "--prefix-cache shares KV pages between prompts, and dense caches have none: add "
            "--max-pages N (or --page-size N)"
        )
    problem = check_speculative_arguments(args, "hybrid" if serving else "alternate")
    if problem:
        return problem
    if args.prefix_cache is None:
        args.prefix_cache = serving and paged
    if paged:
        args.page_size = args.page_size or DEFAULT_PAGE_SIZE
        args.read_in_place = args.read_in_place is not False
    return check_sizes(args) if args.max_seq_len is not None else None


def page_flags(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """The flags that ask for pages, and whether each was given."""
    return [
        ("--max-pages", args.max_pages is not None),
        ("--page-size", args.page_size is not None),
        ("--read-in-place" if args.read_in_place else "--gather", args.read_in_place is not None),
        ("--prefix-cache", bool(args.prefix_cache)),
    ]


def check_sizes(args: argparse.Namespace) -> str | None:
    """--page-size and --max-pages against --max-seq-len."""
    if args.page_size is not None and args.page_size > args.max_seq_len:
        return (
            f"--page-size {args.page_size} is more than --max-seq-len {args.max_seq_len}: a page "
            "would hold more tokens than a request can have"
        )
    if args.max_pages is not None:
        pages = -(-args.max_seq_len // args.page_size)
        if args.max_pages < pages:
            return (
                f"--max-pages {args.max_pages} of {args.page_size} tokens hold "
                f"{args.max_pages * args.page_size} tokens, but one request may grow to "
                f"--max-seq-len {args.max_seq_len} tokens ({pages} pages): give --max-pages "
                f"{pages} or more, or a smaller --max-seq-len"
            )
    return None


def checkpoint_paths(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """--model and the draft model of --speculative as checkpoint directories (downloaded if
    need be): an unknown name or a missing directory is a one-line UsageError; weights neither
    cached nor downloadable raise ModelNotAvailableError."""
    try:
        path = model_path(args.model, args.cache_dir)
    except ValueError as e:
        raise UsageError(str(e)) from e
    return path, draft_path(args)


def check_model(
    args: argparse.Namespace, config: Any, dtype: str, weight_bytes: int = 0
) -> str | None:
    """What is wrong with the settings for this model in `dtype`, or None. serve's sizes left
    open are filled in first, from the memory its weights (`weight_bytes`) leave
    (kv_memory.plan)."""
    import mlx.core as mx

    if getattr(args, "memory_fraction", None) is not None:
        problem = kv_memory.plan(args, config, dtype, weight_bytes) or check_sizes(args)
        if problem:
            return problem
    limit = config.max_position_embeddings
    if args.max_seq_len > limit:
        return (
            f"--max-seq-len {args.max_seq_len} is more than the model's {limit} positions "
            "(max_position_embeddings in its config.json)"
        )
    return kv_memory.check(args, config, dtype, mx.get_memory_limit())


def build_model(package: Any, ckpt: Any, args: argparse.Namespace) -> Any:
    """The solution's Qwen3Model with these settings (compiled or not)."""
    options = model_options(package, args)  # --quantized-linear, --linear-kernel
    if args.compile:
        return package.Qwen3Model(ckpt, max_seq_len=args.max_seq_len, compiled=True, **options)
    return package.Qwen3Model(ckpt, max_seq_len=args.max_seq_len, **options)


def make_pools(model: Any, args: argparse.Namespace) -> list | None:
    """A page pool per layer when pages were asked for (call after model.shard, so that
    each rank's pools hold its own KV heads), else None: dense caches."""
    if args.page_size is None:
        return None
    # the keyword only when on: a solution from before Week 4 Day 4 still serves without it
    shared = {"prefix_cache": True} if args.prefix_cache else {}
    return model.create_kv_pools(
        args.page_size, args.max_pages, read_in_place=args.read_in_place, **shared
    )


def check_solution(args: argparse.Namespace, pools: list | None) -> None:
    """Reach the prefix cache's first task once, before any request: a solution that has not
    written Week 4 Day 4 stops at start-up with the task's NotImplementedError (and
    unfinished_hint names --no-prefix-cache) rather than when a server's first request
    arrives. A lookup in an empty index changes nothing."""
    if args.prefix_cache and pools:
        pools[0].lookup(-1, (0,) * pools[0].page_size)


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """The engine's sizes (--max-seq-len, --batch-size, --prefill-step) as the keywords that
    Engine and batch_generate both take."""
    return {
        "max_seq_len": args.max_seq_len,
        "batch_size": args.batch_size,
        "prefill_step": args.prefill_step,
    }


def batch_keywords(
    args: argparse.Namespace, pools: list | None, proposer: Any = None
) -> dict[str, Any]:
    """batch_generate's keywords for these settings, beyond the 3.1 ones."""
    keywords: dict[str, Any] = engine_keywords(proposer)
    if args.policy != "alternate":
        keywords["policy"] = args.policy
    if pools is not None:
        keywords["pools"] = pools
    return keywords

"""How batch-main and serve run the scheduler: the settings of Week 3 Days 3 to 6 and Week 4
Days 4 and 5, from the command line to the model, the page pools and batch_generate's keywords,
and the lines that describe them.

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

Speculative decoding's guesses are extra rows of a ragged pass, where the hybrid policy puts
prompt chunks beside them, so --speculative brings --policy hybrid with it (in batch-main, whose
policy is alternate without it); an explicit --policy alternate checks the guesses in passes of
their own. `ngram` is prompt lookup; anything else names a draft model the way --model does, checked
at start-up to share the model's vocabulary.

Every check here runs before any model call; a setting a solution has not written yet stops
with its task message when batch_generate reaches it (serve looks for the prefix cache's first
task and for each of speculative decoding's tasks at start-up, see check_solution and
check_proposer).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import kv_memory
from .cli import UsageError, int_at_least, model_path
from .models import resolve_model

POLICIES = ("alternate", "hybrid")
DEFAULT_PAGE_SIZE = 16
NGRAM = "ngram"  # --speculative's prompt lookup; any other value names a draft model
DEFAULT_DRAFT_TOKENS = 4
LOOKUP_NGRAM = 3  # the longest run of last tokens prompt lookup looks for


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


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """--speculative and --num-draft-tokens (Week 4 Day 5)."""
    g = p.add_argument_group("speculative decoding (Week 4 Day 5)")
    g.add_argument(
        "--speculative",
        type=speculative_source,
        default=None,
        metavar="ngram|MODEL",
        help=f"guess the next tokens and check them in the decode pass: '{NGRAM}' copies what "
        "followed the last tokens where they occurred before in the prompt or answer; else a "
        "draft model with the model's vocabulary, named as for --model (tiny, a shortcut, a "
        "checkpoint directory); brings --policy hybrid (default: off)",
    )
    g.add_argument(
        "--num-draft-tokens",
        type=int_at_least(1),
        default=None,
        metavar="K",
        help=f"guesses per request and pass, at most (default {DEFAULT_DRAFT_TOKENS}; "
        "with --speculative)",
    )


def speculative_source(value: str) -> str:
    """An argparse type: --speculative's value, not empty (an empty path would be the current
    directory)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"expected '{NGRAM}' or a draft model, got {value!r}")
    return value


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


def check_speculative_arguments(args: argparse.Namespace, policy: str) -> str | None:
    """--speculative and --num-draft-tokens; fills in the policy when none was given (hybrid
    with speculation, else `policy`) and the number of guesses."""
    if args.speculative is None:
        if args.num_draft_tokens is not None:
            return (
                "--num-draft-tokens is how many tokens --speculative guesses: add --speculative "
                f"{NGRAM} (or a draft model)"
            )
        args.policy = args.policy or policy
        return None
    args.policy = args.policy or "hybrid"
    args.num_draft_tokens = args.num_draft_tokens or DEFAULT_DRAFT_TOKENS
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


def draft_path(args: argparse.Namespace) -> Path | None:
    """The draft model's checkpoint directory (downloaded if need be), or None without one
    (no --speculative, or prompt lookup). An unknown name or a missing directory is a one-line
    UsageError; weights neither cached nor downloadable raise ModelNotAvailableError."""
    source = getattr(args, "speculative", None)
    if source is None or source == NGRAM:
        return None
    try:
        return resolve_model(source, cache_dir=getattr(args, "cache_dir", None))
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(
            f"--speculative {source}: {e} (it takes '{NGRAM}', or a draft model named as for "
            "--model)"
        ) from e


def check_draft(args: argparse.Namespace, config: Any, draft_config: Any) -> str | None:
    """What is wrong with the draft model (its config) beside this model's, or None."""
    name = f"the draft model {args.speculative!r}"
    if draft_config.vocab_size != config.vocab_size:
        return (
            f"{name} has a vocabulary of {draft_config.vocab_size} tokens and --model "
            f"{args.model!r} one of {config.vocab_size}: a draft's guesses are the model's token "
            "ids, so it must share the model's vocabulary (--speculative ngram needs no draft)"
        )
    limit = draft_config.max_position_embeddings
    if args.max_seq_len > limit:
        return (
            f"--max-seq-len {args.max_seq_len} is more than {name}'s {limit} positions "
            "(max_position_embeddings in its config.json)"
        )
    return None


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
    if args.compile:
        return package.Qwen3Model(ckpt, max_seq_len=args.max_seq_len, compiled=True)
    return package.Qwen3Model(ckpt, max_seq_len=args.max_seq_len)


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


def make_proposer(package: Any, model: Any, draft_ckpt: Any, args: argparse.Namespace) -> Any:
    """The solution's proposer for --speculative (Week 4 Day 5), or None without the flag:
    PromptLookup for ngram, else DraftModel around the draft checkpoint (eager, with the
    model's --max-seq-len)."""
    if getattr(args, "speculative", None) is None:
        return None
    if not hasattr(package, "PromptLookup"):  # a copy of the course from before Week 4 Day 5
        raise ValueError(
            f"{package.__name__} has no PromptLookup or DraftModel: --speculative needs Week 4 "
            "Day 5 (speculative.py)"
        )
    k = args.num_draft_tokens
    if draft_ckpt is None:
        return package.PromptLookup(num_draft_tokens=k, ngram=LOOKUP_NGRAM)
    draft = package.Qwen3Model(draft_ckpt, max_seq_len=args.max_seq_len)
    return package.DraftModel(draft, model, num_draft_tokens=k)


def check_proposer(package: Any, proposer: Any, model: Any, tokenizer: Any) -> None:
    """Reach each task of Week 4 Day 5 once, before any request, in the order a request
    would: a solution that has not written one stops at start-up with its NotImplementedError
    (unfinished_hint then says the server runs without --speculative). The inputs are the
    smallest a pass can give (a two-token prompt, drafts of no guesses); the probe request is
    released and nothing is counted."""
    import mlx.core as mx

    spec = package.speculative
    probe = package.Request(model, tokenizer, [0, 0], prompt_idx=-1)  # greedy, dense caches
    try:
        proposer.propose(probe, 1)  # Task 1: prompt lookup or the draft model
    finally:
        proposer.forget(set())
        probe.release()
    spec.accept_greedy([0], [])  # Task 2
    spec.accept_sampled(mx.array([[1.0]]), spec.Draft([]), lambda: mx.random.key(0))  # Task 3
    spec.keep_checked([], mx.zeros((0, 1)), proposer)  # Task 4


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """The engine's sizes (--max-seq-len, --batch-size, --prefill-step) as the keywords that
    Engine and batch_generate both take."""
    return {
        "max_seq_len": args.max_seq_len,
        "batch_size": args.batch_size,
        "prefill_step": args.prefill_step,
    }


def engine_keywords(proposer: Any) -> dict[str, Any]:
    """Engine's keywords for speculation: none without it, so that a solution from before Week
    4 Day 5 still serves."""
    return {} if proposer is None else {"speculative": proposer}


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


def describe(args: argparse.Namespace) -> str:
    """One line: the policy, compilation, the KV storage and speculation."""
    if args.policy == "hybrid":
        policy = f"hybrid policy (one pass: decode rows + prompt chunks, {args.prefill_step} rows)"
    else:
        policy = "alternate policy (a prefill chunk, then a decode pass)"
    compiled = "compiled, padded chunks" if args.compile else "eager"
    if args.page_size is None:
        kv = "dense KV caches"
    else:
        pages = f"pages of {args.page_size} tokens"
        if args.max_pages is not None:
            pages = f"{args.max_pages} {pages} ({args.max_pages * args.page_size} in all)"
        read = "read in place" if args.read_in_place else "gathered"
        shared = "prefix cache" if args.prefix_cache else "no prefix cache"
        kv = f"paged KV: {pages} per layer, {read}, {shared}"
    line = f"scheduler: {policy}, {compiled}, {kv}"
    source = getattr(args, "speculative", None)
    if source is not None:
        how = "prompt lookup" if source == NGRAM else f"draft model {source}"
        line += (
            f", speculative decoding: {how}, up to {args.num_draft_tokens} guesses per request "
            "and pass"
        )
    return line


def unfinished_hint(
    args: argparse.Namespace, error: NotImplementedError, command: str = "the server"
) -> str:
    """A way around a missing exercise that is only a setting's; `command` names what runs
    without it."""
    if args.read_in_place and "Week 3 Day 5" in str(error):
        return "; --gather serves the pages without Week 3 Day 5"
    if args.prefix_cache and "Week 4 Day 4" in str(error):
        return "; --no-prefix-cache serves the pages without Week 4 Day 4"
    if getattr(args, "speculative", None) is not None and "Week 4 Day 5" in str(error):
        return f"; without --speculative {command} runs without Week 4 Day 5"
    return ""


def summary_lines(
    model: Any, pools: list | None, cached_tokens: int = 0, proposer: Any = None
) -> list[str]:
    """What the settings did over the run: compilations, the pool's peak, with a prefix
    cache the tokens its admissions found cached (`cached_tokens`, the sum of the "admit"
    events' tokens; a preempted request admitted again counts too), and with speculation the
    guesses the proposer made and the model kept."""
    lines = []
    stats = model.compile_stats() if getattr(model, "compiled", False) else None
    if stats:
        lines.append(
            f"compiled: {stats['compiles']} variants compiled, {stats['hits']} reused, "
            f"{stats['evictions']} evicted (a variant per input shape, Week 3 Day 3)"
        )
    if pools:
        pool = pools[0]
        limit = f" of {pool.max_pages}" if pool.max_pages is not None else ""
        lines.append(
            f"pages: at most {pool.peak_in_use}{limit} in use per layer, {pool.num_in_use} "
            f"at the end, {pool.num_allocations} handed out in all"
        )
        if hasattr(pool, "num_cached"):
            lines.append(
                f"prefix cache: {cached_tokens} tokens found cached at admissions, "
                f"{pool.num_cached} pages cached at the end, {pool.evictions} evicted"
            )
    if proposer is not None:
        lines.append(speculative_line(proposer.proposed, proposer.accepted))
    return lines


def speculative_line(proposed: int, accepted: int) -> str:
    """The guesses made and kept over the run, and the share kept."""
    share = f" ({accepted / proposed:.0%})" if proposed else ""
    return f"speculative decoding: {proposed} tokens proposed, {accepted} accepted{share}"

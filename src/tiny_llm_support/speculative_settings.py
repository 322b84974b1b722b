"""Speculative decoding (Week 4 Day 5) as batch-main and serve run it: --speculative and
--num-draft-tokens, the draft model's checkpoint and its checks, and the solution's proposer. The
scheduler's other settings are batch_settings'.

Speculative decoding's guesses are extra rows of a ragged pass, where the hybrid policy puts
prompt chunks beside them, so --speculative brings --policy hybrid with it (in batch-main, whose
policy is alternate without it); an explicit --policy alternate checks the guesses in passes of
their own. `ngram` is prompt lookup; anything else names a draft model the way --model does, checked
at start-up to share the model's vocabulary.

Serve reaches each task of the day at start-up (check_proposer), so that a solution without one
stops there with its task message rather than at a request.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .cli import UsageError, int_at_least
from .models import resolve_model

NGRAM = "ngram"  # --speculative's prompt lookup; any other value names a draft model
DEFAULT_DRAFT_TOKENS = 4
LOOKUP_NGRAM = 3  # the longest run of last tokens prompt lookup looks for


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


def engine_keywords(proposer: Any) -> dict[str, Any]:
    """Engine's keywords for speculation: none without it, so that a solution from before Week
    4 Day 5 still serves."""
    return {} if proposer is None else {"speculative": proposer}

"""The lines batch-main and serve print about the scheduler's settings (batch_settings.py,
speculative_settings.py): the one that describes them at start-up (describe), the way around an
exercise that only a setting needs (unfinished_hint), and what they did over a run
(summary_lines).
"""

from __future__ import annotations

import argparse
from typing import Any

from .speculative_settings import NGRAM


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

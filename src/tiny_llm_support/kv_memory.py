"""What the KV caches need, and how serve sizes them from the machine's memory (Week 3 Day 6's
planning, done once at start-up, the way vLLM sizes its KV cache from a share of the GPU).

A token's keys and values take 2 x layers x KV heads x head_dim numbers, the same in dense
caches and in a page pool. serve gives the weights and the KV storage together a share of the
memory MLX may use (--memory-fraction, default 0.5). The context defaults to the model's
positions as far as what the weights leave holds them; the pool gets room for every slot at
full context and as much again for the prefix cache (Week 4 Day 4) to keep, in whole pages
per layer, never more than the share holds. The pool grows as pages are handed out (Week 2
Day 2), so its size is a ceiling, reached only when the prefix cache has kept that many pages;
a small model does not take half the machine for a cache it could never fill. With --dense,
every slot keeps a row as long as the context, so the share bounds --batch-size x context.

batch-main keeps its teaching sizes (dense caches, 512 tokens, 5 slots): there the only check
is that the caches asked for fit in the memory MLX may use.
"""

from __future__ import annotations

import argparse
from typing import Any

from .cli import DTYPES

DEFAULT_MEMORY_FRACTION = 0.5
GIB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    """serve's --dense and --memory-fraction."""
    p.add_argument(
        "--dense",
        action="store_true",
        help="dense KV caches, a row per slot (Week 3 Day 1), instead of the paged pool read in "
        "place with a prefix cache",
    )
    p.add_argument(
        "--memory-fraction",
        type=fraction,
        default=DEFAULT_MEMORY_FRACTION,
        help="the share of the memory MLX may use that the weights and KV storage take "
        "together: the page pool gets what the weights leave (with --max-pages: unused)",
    )


def fraction(value: str) -> float:
    """An argparse type: a number above 0 and at most 1."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"expected a number above 0 and at most 1, got {value}")
    return number


def bytes_per_token(config: Any, dtype: str) -> int:
    """The keys and values of one token over every layer."""
    numbers = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return numbers * DTYPES[dtype].size


def plan(args: argparse.Namespace, config: Any, dtype: str, weight_bytes: int) -> str | None:
    """serve's sizes from memory: fills in --max-seq-len and, over pages, --max-pages (each
    unless given), or says why the share cannot hold them. args.memory_line: the start-up
    line that says what they came to (None when nothing was left open)."""
    import mlx.core as mx

    args.memory_line = None
    if args.max_seq_len is not None and (args.dense or args.max_pages is not None):
        return None  # sized by hand: kv_memory.check alone looks at them
    if not args.dense and args.max_pages is not None:  # the pool by hand, the context open
        args.max_seq_len = min(config.max_position_embeddings, args.max_pages * args.page_size)
        args.memory_line = f"KV memory: context {args.max_seq_len:,} tokens (--max-pages)"
        return None
    limit = mx.get_memory_limit()
    budget = int(args.memory_fraction * limit) - weight_bytes
    share = (
        f"--memory-fraction {args.memory_fraction} of the {limit / GIB:.1f} GiB MLX may use, "
        f"less {weight_bytes / GIB:.2f} GiB of weights"
    )
    per_token = bytes_per_token(config, dtype)
    page = args.page_size or 1  # dense rows: a "page" of one token
    room = budget // (per_token * page) * page  # tokens the share holds, in whole pages
    if args.dense:
        room //= args.batch_size  # each slot keeps a row of its own
    if room < (1 if args.dense else args.batch_size * page):
        return (
            f"{share}, leaves room for {max(0, room)} tokens, too few for --batch-size "
            f"{args.batch_size} (each running request needs a page or a row of its own): give "
            "a larger --memory-fraction" + ("" if args.dense else ", or --max-pages N")
        )
    said = []  # the start-up line's parts, in order: the storage, then the context
    context = None
    if args.max_seq_len is None:
        positions = config.max_position_embeddings
        args.max_seq_len = min(positions, room)
        why = "the model's positions" if positions <= room else "what the memory holds"
        context = f"context {args.max_seq_len:,} tokens ({why})"
    if args.dense:
        said.append(f"{share}: rows of up to {room:,} tokens for {args.batch_size} slots")
    else:
        # every slot at full context, and as much again for the prefix cache to keep
        wanted = 2 * args.batch_size * -(-args.max_seq_len // page)
        args.max_pages = min(room // page, wanted)
        tokens = args.max_pages * page
        if args.max_pages < wanted:
            held = "all the share holds"
        else:
            held = f"twice --batch-size {args.batch_size} requests of the whole context"
        said.append(
            f"{share}: at most {args.max_pages:,} pages per layer ({tokens:,} tokens, "
            f"{tokens * per_token / GIB:.2f} GiB when full; {held})"
        )
    if context:
        said.append(context)
    args.memory_line = f"KV memory: {'; '.join(said)}"
    return None


def check(args: argparse.Namespace, config: Any, dtype: str, limit: int) -> str | None:
    """Settings whose KV caches alone could not fit in `limit` bytes, or None. Dense caches keep
    a row for every slot, as long as the longest request: --batch-size rows of up to
    --max-seq-len tokens. A page pool with --max-pages holds that many pages, and as every
    running request writes to a page of its own, no more requests than pages run at once."""
    per_token = bytes_per_token(config, dtype)
    if args.max_pages is None:
        tokens = args.batch_size * args.max_seq_len
        held = f"--batch-size {args.batch_size} rows of --max-seq-len {args.max_seq_len} tokens"
    elif args.batch_size > args.max_pages:
        return (
            f"--batch-size {args.batch_size} is more than --max-pages {args.max_pages}: every "
            "running request writes to a page of its own, so the other slots would stay empty"
        )
    else:
        tokens = args.max_pages * args.page_size
        held = f"--max-pages {args.max_pages} of {args.page_size} tokens"
    need = tokens * per_token
    if need > limit:
        return (
            f"{held} need {need / GIB:.1f} GiB of KV cache ({per_token} bytes a token in "
            f"{dtype}), more than the {limit / GIB:.1f} GiB MLX may use on this machine"
        )
    return None

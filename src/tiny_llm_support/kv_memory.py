"""What the KV caches need, and how serve sizes them from the machine's memory (Week 3 Day 6's
planning, done once at start-up, the way vLLM sizes its KV cache from a share of the GPU).

A token's keys and values take 2 x layers x KV heads x head_dim numbers, the same in dense
caches and in a page pool. serve gives the weights and the KV storage together a share of the
memory MLX may use (--memory-fraction, default 0.5): what the weights leave is the pool, in
whole pages per layer, and the context defaults to the model's positions as far as that pool
holds them. The pool grows as pages are handed out (Week 2 Day 2), so the share is a ceiling,
reached only when the prefix cache (Week 4 Day 4) has kept that many pages. With --dense,
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
    """serve's sizes from memory: fills in --max-pages (paged, unless given) and --max-seq-len
    (unless given), or says why the share cannot hold them. args.memory_line: the start-up
    line that says what they came to (None when nothing was left open)."""
    import mlx.core as mx

    limit = mx.get_memory_limit()
    budget = int(args.memory_fraction * limit) - weight_bytes
    share = (
        f"--memory-fraction {args.memory_fraction} of the {limit / GIB:.1f} GiB MLX may use, "
        f"less {weight_bytes / GIB:.2f} GiB of weights"
    )
    per_token = bytes_per_token(config, dtype)
    said = []
    if args.dense:
        room = budget // (args.batch_size * per_token)  # tokens in each slot's row
        if args.max_seq_len is None:
            if room < 1:
                return f"{share}, leaves no room for --batch-size {args.batch_size} dense rows"
            said.append(f"{share}: {room} tokens for each of {args.batch_size} dense rows")
    else:
        if args.max_pages is None:
            args.max_pages = max(0, budget // (per_token * args.page_size))
            if args.max_pages < args.batch_size:
                return (
                    f"{share}, leaves {args.max_pages} pages of {args.page_size} tokens, fewer "
                    f"than --batch-size {args.batch_size} (each running request writes to a page "
                    "of its own): give a larger --memory-fraction, or --max-pages N"
                )
            tokens = args.max_pages * args.page_size
            said.append(
                f"{share}: at most {args.max_pages:,} pages per layer ({tokens:,} tokens, "
                f"{tokens * per_token / GIB:.2f} GiB when full)"
            )
        room = args.max_pages * args.page_size
    if args.max_seq_len is None:
        positions = config.max_position_embeddings
        args.max_seq_len = min(positions, room)
        held = "dense rows" if args.dense else "pool"
        why = "the model's positions" if positions <= room else f"what the {held} holds"
        said.append(f"context {args.max_seq_len} tokens ({why})")
    args.memory_line = f"KV memory: {'; '.join(said)}" if said else None
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

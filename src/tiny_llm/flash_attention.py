"""Week 3 Day 5: flash attention, and attention that reads pages where they lie.

Attention needs, for every query row, three sums over the keys it sees: the largest score m, the
sum l of exp(score - m), and the sum o of exp(score - m) * value. A block of keys gives a partial
(m, l, o) of its own; two partials merge exactly into the partial of both blocks. So attention
can walk the keys block by block, keeping one running partial per query row, and never hold
more than one block of scores: the [L, S] score matrix is never built.

flash_attention walks dense key/value arrays in blocks; paged_attention walks page tables, taking
a few pages at a time straight from the pool's storage, so a paged cache is never copied into a
dense [H_kv, S, D] array.
"""

import math

import mlx.core as mx

# m [..., L, 1]: the largest score seen so far per query row (-inf: no visible key yet)
# l [..., L, 1]: the sum of exp(score - m) over those keys
# o [..., L, D]: the sum of exp(score - m) * value over those keys (not yet divided by l)
Partial = tuple[mx.array, mx.array, mx.array]


def finite_max(m: mx.array) -> mx.array:
    """m with -inf replaced by 0. Subtract this, not m: a row that has seen no visible key has
    m = -inf, and exp(-inf - (-inf)) is nan, while exp(-inf - 0) is the 0 it should be."""
    return mx.where(m == -mx.inf, 0.0, m)


def block_partial(scores: mx.array, value: mx.array) -> Partial:
    """The partial result of one block of keys: scores [..., L, K] (-inf where masked),
    value [..., K, D]."""
    raise NotImplementedError("Week 3 Day 5, Task 1: the partial result of one block of keys")


def merge_partials(first: Partial, second: Partial) -> Partial:
    """The partial result of two blocks of keys, from the partials of each."""
    raise NotImplementedError("Week 3 Day 5, Task 1: merge two partial results exactly")


def finish(partial: Partial | None) -> mx.array:
    """The attention output [..., L, D] of a partial that has seen every key."""
    if partial is None:
        raise ValueError(
            "no key block was merged for a block of queries: every query sees at least its own "
            "position, so the key loop must run up to the block's last row (stop at last + 1)"
        )
    _, l, o = partial
    return o / l


def mask_future_keys(scores: mx.array, query_pos: mx.array, key_pos: mx.array) -> mx.array:
    """scores [..., L, K] with -inf where the key comes after the query.

    query_pos: the absolute position of each query row, broadcastable to [..., L, 1];
    key_pos [K]: the absolute position of each key of the block. Only the block's own [L, K]
    comparison is built, never a mask over every key.
    """
    return mx.where(key_pos <= query_pos, scores, -mx.inf)


def _check_heads(query: mx.array, num_kv_heads: int, head_dim: int) -> None:
    if query.ndim != 4:
        raise ValueError(f"query must be [B, H_q, L, D], got shape {query.shape}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"query heads {query.shape[1]} are not a multiple of key/value heads {num_kv_heads}"
        )
    if query.shape[3] != head_dim:
        raise ValueError(f"query head_dim {query.shape[3]} != key/value head_dim {head_dim}")


def flash_attention(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    scale: float | None = None,
    causal: bool = True,
    block_size: int = 128,
) -> mx.array:
    """Exact attention in blocks, with an online softmax.

    query [B, H_q, L, D], key/value [B, H_kv, S, D] with H_q a multiple of H_kv -> [B, H_q, L, D].
    causal: query row i sits at position S - L + i and sees keys 0 ..= S - L + i (the
    rectangular mask of Week 3 Day 2), worked out per block from positions. Queries and keys are
    cut into blocks of block_size rows; a key block that lies after a query block's last row is
    skipped, since every one of its scores would be masked.
    """
    b, _, l, d = query.shape
    _check_heads(query, key.shape[1], key.shape[3])
    if key.shape != value.shape or key.shape[0] != b:
        raise ValueError(f"key {key.shape} and value {value.shape} must be [{b}, H_kv, S, {d}]")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if causal and not 1 <= l <= key.shape[2]:
        raise ValueError(f"causal attention needs 1 <= L <= S, got L={l}, S={key.shape[2]}")
    raise NotImplementedError("Week 3 Day 5, Task 2: tiled attention with an online softmax")


def paged_attention(
    query: mx.array,
    pool,
    page_tables: list[list[int]],
    lengths: list[int],
    scale: float | None = None,
    block_size: int = 128,
) -> mx.array:
    """Causal attention over keys/values that live in a page pool, read where they lie.

    query [B, H_q, L, D]: row b holds the last L positions of a request whose `lengths[b]`
    tokens are stored in the pages `page_tables[b]` of `pool` (a TinyKvPagedPool, whose
    key_pages/value_pages are [num_pages, H_kv, page_size, D]). Returns [B, H_q, L, D].

    The page tables are walked a block at a time, max(1, block_size // page_size) pages per
    block, taken from the pool with one indexing operation; shorter tables are padded, and
    every slot past a row's length is masked (its positions come after the row's queries).
    """
    b, _, l, d = query.shape
    _check_heads(query, pool.num_kv_heads, pool.head_dim)
    if not len(page_tables) == len(lengths) == b:
        raise ValueError(f"{b} query rows need {b} page tables and lengths")
    for table, length in zip(page_tables, lengths):
        if not l <= length <= len(table) * pool.page_size:
            raise ValueError(
                f"a row of {length} tokens in {len(table)} pages of {pool.page_size} cannot "
                f"hold its {l} queries"
            )
    decode_kernel = getattr(pool, "decode_kernel", None)  # Week 5 Day 2: opt-in, per pool
    if l == 1 and decode_kernel is not None and mx.default_device() == mx.cpu:
        return decode_kernel(query, pool, page_tables, lengths, scale)
    raise NotImplementedError(
        "Week 3 Day 5, Task 3: walk the page tables a block of pages at a time"
    )

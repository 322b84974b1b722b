"""Week 3 Day 5: flash attention over pages.

Task 1  block_partial and merge_partials: the online softmax. A block of keys gives a partial
        (m, l, o); two partials merge exactly into the partial of both blocks.
Task 2  flash_attention(query, key, value, scale, causal, block_size): attention in blocks of
        queries and keys, the causal mask worked out per block from positions, blocks above the
        diagonal skipped; the [L, S] score matrix is never built.
Task 3  paged_attention(query, pool, page_tables, lengths) and TinyKvPagedCache.attend: the
        pool's pages read where they lie, a few pages per block, never gathered.
Task 4  BatchingKvCache.attend: batched decode over a padded page table; with pools made with
        read_in_place=True the model (eager, compiled, ragged, batched) reads pages in place.
Task 5  TinyKvPagedCache.reserve and attend_in_place: 3.4's ragged pass over a pool read in
        place writes every segment's keys/values in one scatter per layer, then attends, every
        decode row in one paged_attention call.

Oracles: mx.fast.scaled_dot_product_attention, mx.softmax over all the scores at once, the
dense cache's logits and texts. Spies record the shape of every array the code under test
builds through mlx.core, and make the pool's gather fail.
"""

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_close, prompt_with_tokens, release_all

ATOL = RTOL = 1e-5
D = 16  # head_dim of the direct tests: distinct from every block size and length below


def random_array(shape, seed: int, shift: float = 0.0) -> mx.array:
    rng = np.random.RandomState(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32) + shift)


def random_qkv(b, h_q, h_kv, l, s, seed=0):
    """query [B, H_q, L, D], key/value [B, H_kv, S, D]"""
    q = random_array((b, h_q, l, D), seed)
    k = random_array((b, h_kv, s, D), seed + 1)
    v = random_array((b, h_kv, s, D), seed + 2)
    return q, k, v


def oracle(q, k, v, scale=None, causal=True) -> mx.array:
    """mx.fast's attention; its "causal" mask sits bottom-right: row i sees keys 0 ..= S - L + i."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask="causal" if causal else None
    )


def close(actual, expected, what, atol=ATOL, rtol=RTOL):
    assert_close(actual, expected, what, atol=atol, rtol=rtol)


class ShapeSpy:
    """Records the shape of every array built through mlx.core functions and array methods and
    operators while it is installed (install with monkeypatch; undo removes it)."""

    OPERATORS = (
        "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __div__ "
        "__rdiv__ __matmul__ __getitem__ __neg__ __lt__ __le__ __gt__ __ge__ __eq__ __ne__ "
        "__and__ __or__ __invert__ __pow__ __rpow__ __mod__ __floordiv__"
    ).split()

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, ...]] = []
        for name in dir(mx):
            fn = getattr(mx, name)
            if callable(fn) and not isinstance(fn, type) and not name.startswith("_"):
                monkeypatch.setattr(mx, name, self._wrap(fn))
        for name in dir(mx.array):
            method = getattr(mx.array, name)
            public = not name.startswith("_") and name not in ("item", "tolist")
            if callable(method) and (public or name in self.OPERATORS):
                monkeypatch.setattr(mx.array, name, self._wrap(method))

    def _wrap(self, fn):
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            for a in out if isinstance(out, list | tuple) else [out]:
                if isinstance(a, mx.array):
                    self.shapes.append(tuple(a.shape))
            return out

        return recorded


def no_gather(*args, **kwargs):
    raise AssertionError(
        "pool.gather copies a request's pages into one dense array: read them in place"
    )


# --- Task 1: the online softmax --------------------------------------------------------------


def split_partials(impl, scores, values, cuts):
    """The partials of the blocks between consecutive cuts of the key axis."""
    bounds = [0, *cuts, scores.shape[-1]]
    return [
        impl.block_partial(scores[..., a:b], values[..., a:b, :])
        for a, b in zip(bounds, bounds[1:])
    ]


def check_partial(partial, scores, values, what):
    """A partial over `scores` [..., L, K] must hold the row maximum, the sum of exp(score - max)
    and the weighted sum of values, all at that maximum."""
    m, l, o = partial
    want_m = mx.max(scores, axis=-1, keepdims=True)
    weights = mx.exp(scores - want_m)
    close(m, want_m, f"{what}: m, the largest score of each query row")
    close(
        l,
        mx.sum(weights, axis=-1, keepdims=True),
        f"{what}: l, the sum of exp(score - m). If only merged partials are wrong: when the "
        "maximum changes, both running sums must be rescaled by exp(old max - new max) before "
        "they are added",
    )
    close(
        o,
        weights @ values,
        f"{what}: o, the sum of exp(score - m) * value, not yet divided by l. If only merged "
        "partials are wrong: rescale each o by the same factor as its l",
    )
    close(o / l, mx.softmax(scores, axis=-1) @ values, f"{what}: o / l is attention")


def test_block_partial_holds_max_sum_and_weighted_values(impl):
    scores = random_array((2, 3, 4, 7), seed=0)  # [B, H, L, K]
    values = random_array((2, 3, 7, D), seed=1)
    check_partial(impl.block_partial(scores, values), scores, values, "one block")


@pytest.mark.parametrize("cuts", [[5], [1], [11], [3, 8], [2, 4, 6, 9]])
def test_merged_blocks_equal_one_block_over_all_keys(impl, cuts):
    """The second half of the keys scores 20 higher: the maximum changes in the merge, and
    exp(20) would swamp a sum that was not rescaled."""
    scores = random_array((1, 2, 3, 12), seed=2)
    scores = mx.concatenate([scores[..., :6], scores[..., 6:] + 20.0], axis=-1)
    values = random_array((1, 2, 12, D), seed=3)
    parts = split_partials(impl, scores, values, cuts)
    merged = parts[0]
    for part in parts[1:]:
        merged = impl.merge_partials(merged, part)
    check_partial(merged, scores, values, f"blocks cut at {cuts}, merged left to right")


def test_merge_is_associative_and_commutative(impl):
    scores = random_array((2, 2, 5, 9), seed=4) * 4.0
    values = random_array((2, 2, 9, D), seed=5)
    a, b, c = split_partials(impl, scores, values, [3, 5])
    merge = impl.merge_partials
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    swapped = merge(c, merge(b, a))
    for got, what in [(left, "(a + b) + c"), (right, "a + (b + c)"), (swapped, "c + (b + a)")]:
        check_partial(got, scores, values, what)


def empty_partial(l: int) -> tuple:
    """The partial of no keys at all: no maximum yet (-inf), nothing summed."""
    return (
        mx.full((1, 2, l, 1), -mx.inf),
        mx.zeros((1, 2, l, 1)),
        mx.zeros((1, 2, l, D)),
    )


def test_merging_with_an_empty_block_changes_nothing(impl):
    scores = random_array((1, 2, 3, 5), seed=6)
    values = random_array((1, 2, 5, D), seed=7)
    part = impl.block_partial(scores, values)
    for merged, what in [
        (impl.merge_partials(part, empty_partial(3)), "partial + empty"),
        (impl.merge_partials(empty_partial(3), part), "empty + partial"),
    ]:
        for got, want, name in zip(merged, part, "mlo"):
            assert not np.isnan(np.array(got)).any(), (
                f"{what}: {name} holds nan. The empty side has m = -inf, and exp(-inf - (-inf)) "
                "is nan: subtract finite_max(m), not m"
            )
            close(got, want, f"{what}: {name} must be the partial itself")


def test_a_block_with_every_score_masked(impl):
    """A block the causal mask hides entirely from some rows: -inf scores, no nan anywhere,
    and merging it in changes nothing."""
    scores = random_array((1, 2, 3, 4), seed=8)
    values = random_array((1, 2, 4, D), seed=9)
    hidden = mx.full((1, 2, 3, 4), -mx.inf)
    masked = impl.block_partial(hidden, values)
    for got, name in zip(masked, "mlo"):
        assert not np.isnan(np.array(got)).any(), (
            f"a fully masked block gave nan in {name}: exp(-inf - (-inf)) is nan, "
            "subtract finite_max(m) instead of m"
        )
    m, l, o = masked
    assert np.isneginf(np.array(m)).all(), "no visible key: the block's maximum stays -inf"
    close(l, mx.zeros_like(l), "no visible key: the sum of weights is 0")
    close(o, mx.zeros_like(o), "no visible key: the weighted values are 0")
    part = impl.block_partial(scores, values)
    for merged, what in [
        (impl.merge_partials(part, masked), "partial + masked"),
        (impl.merge_partials(masked, part), "masked + partial"),
    ]:
        for got, want, name in zip(merged, part, "mlo"):
            close(got, want, f"{what}: {name}")
    both = impl.merge_partials(masked, masked)
    assert not any(np.isnan(np.array(x)).any() for x in both), "masked + masked gave nan"


# --- Task 2: flash_attention -----------------------------------------------------------------

# (L, S, block_size): one query, a chunk after a prefix, a whole prompt, S not a multiple of
# the block, blocks larger than S, blocks of one key
SHAPES = [
    (1, 1, 4),
    (1, 45, 8),
    (6, 45, 8),
    (5, 40, 8),
    (45, 45, 8),
    (32, 32, 8),
    (9, 23, 64),
    (7, 13, 1),
]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa-2", "gqa-4"])
@pytest.mark.parametrize("l, s, block", SHAPES)
def test_flash_attention_matches_mx_fast(impl, heads, l, s, block):
    q, k, v = random_qkv(2, *heads, l, s, seed=l * 100 + s)
    got = impl.flash_attention(q, k, v, block_size=block)
    hint = (
        " A chunk at an offset: query row i sits at position S - L + i, so work out each "
        "block's mask from those positions, not from row numbers starting at 0."
        if 1 < l < s
        else ""
    )
    close(got, oracle(q, k, v), f"causal, L={l}, S={s}, block {block}, heads {heads}.{hint}")
    got = impl.flash_attention(q, k, v, scale=0.3, causal=False, block_size=block)
    close(got, oracle(q, k, v, scale=0.3, causal=False), f"not causal, scale 0.3, L={l}, S={s}")


def test_flash_attention_default_arguments(impl):
    q, k, v = random_qkv(1, 2, 1, 3, 300, seed=11)
    close(impl.flash_attention(q, k, v), oracle(q, k, v), "default scale and block_size")


@pytest.mark.parametrize("l, s", [(40, 40), (3, 40), (1, 40), (12, 40)])
def test_flash_attention_never_builds_the_score_matrix(impl, monkeypatch, l, s):
    block = 8
    q, k, v = random_qkv(1, 4, 2, l, s, seed=12)
    spy = ShapeSpy(monkeypatch)
    out = impl.flash_attention(q, k, v, block_size=block)
    monkeypatch.undo()
    # scores and masks are [..., rows, keys]; q, k, v and outputs end in D, k transposed in [D, S]
    wide = [x for x in spy.shapes if len(x) >= 2 and x[-1] > block and D not in x[-2:]]
    assert not wide, (
        f"flash_attention(L={l}, S={s}, block_size={block}) built arrays of shapes "
        f"{sorted(set(wide))}: scores or a mask over more than {block} keys at once. Walk the "
        "keys in blocks of block_size, and make each block's mask from positions"
    )
    close(out, oracle(q, k, v), "with the spy installed")


@pytest.mark.parametrize("l, s", [(32, 32), (16, 40), (12, 40)])
def test_key_blocks_after_a_query_block_are_skipped(impl, l, s):
    """Keys after position p are poisoned with nan; the query rows at positions up to p must
    still come out right, so the blocks holding those keys were never read for them. Reading
    one (even masked: 0 * nan is nan) or not cutting the queries into blocks spoils them."""
    block = 8
    q, k, v = random_qkv(1, 4, 2, l, s, seed=13)
    first = s - l  # position of query row 0
    clean = first + block  # the first query block holds positions first .. first + block - 1
    poisoned = mx.arange(s)[:, None] >= clean  # [S, 1]
    k_bad = mx.where(poisoned, mx.nan, k)
    v_bad = mx.where(poisoned, mx.nan, v)
    got = impl.flash_attention(q, k_bad, v_bad, block_size=block)[:, :, :block]
    want = oracle(q, k, v)[:, :, :block]
    assert not np.isnan(np.array(got)).any(), (
        f"query rows at positions {first}..{clean - 1} read keys from position {clean} on: "
        "cut the queries into blocks too, and for each query block stop the keys at its last "
        "row: skip the key blocks after it and cut the key block that straddles it there "
        "(stop = last position + 1), since a key read even masked gives 0 * nan = nan"
    )
    close(got, want, "the first query block with later keys poisoned")


def test_flash_attention_rejects_bad_shapes(impl):
    q, k, v = random_qkv(1, 4, 2, 3, 10)
    with pytest.raises(ValueError):
        impl.flash_attention(random_array((1, 3, 3, D), 0), k, v)  # 3 heads over 2
    with pytest.raises(ValueError):
        impl.flash_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError):
        impl.flash_attention(random_array((1, 4, 11, D), 0), k, v)  # causal needs L <= S
    with pytest.raises(ValueError):
        impl.flash_attention(q, k, v[:, :, :9])
    close(impl.flash_attention(q, k, v, block_size=4), oracle(q, k, v), "the good call")


# --- Task 3: pages read in place -------------------------------------------------------------


def fill_pool(impl, page_size, lengths, seed=0, heads=2):
    """A pool of `heads` KV heads and requests of `lengths` tokens appended in interleaved
    pieces of 3, so each page table is scattered. Returns the pool, the caches, and each
    request's keys and values as dense [1, H_kv, S, D] arrays. Pages come off a scrambled free
    list, so a table is not in increasing page order either."""
    pool = impl.TinyKvPagedPool(heads, D, page_size=page_size, read_in_place=True)
    pages = [pool.allocate() for _ in range(sum(-(-n // page_size) for n in lengths))]
    for page in np.random.RandomState(seed).permutation(pages).tolist():
        pool.free(page)  # the free list hands pages out in a scrambled order
    caches = [impl.TinyKvPagedCache(pool) for _ in lengths]
    dense = [(random_array((1, heads, n, D), seed + 2 * i), random_array((1, heads, n, D), seed + 2 * i + 1)) for i, n in enumerate(lengths)]  # fmt: skip
    for start in range(0, max(lengths), 3):
        for cache, (k, v), n in zip(caches, dense, lengths):
            if start < n:
                cache.append(k[:, :, start : start + 3], v[:, :, start : start + 3])
    return pool, caches, dense


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("l", [1, 5, 45])
@pytest.mark.parametrize("block", [1, 8, 128])
def test_paged_attention_equals_dense_attention(impl, page_size, l, block):
    pool, caches, dense = fill_pool(impl, page_size, [45, 17])
    k, v = dense[0]
    q = random_array((1, 4, l, D), seed=20)
    table = caches[0].page_table
    got = impl.paged_attention(q, pool, [table], [45], block_size=block)
    want, hint = oracle(q, k, v), ""
    if l > 1:
        hint = " A chunk of L queries at the end of S tokens: row i sits at position S - L + i."
    wrong = not np.allclose(got, want, atol=ATOL, rtol=RTOL)  # name the slip only on a failure
    if wrong and np.allclose(got, oracle(q, *sorted_pages(table, page_size, k, v)), 1e-4):
        hint = " The keys were read with the pages sorted by page number: " + IN_TABLE_ORDER
    close(got, want, f"page size {page_size}, L={l}, block {block}.{hint}")


IN_TABLE_ORDER = (
    "read page table[j] for positions j * page_size .. (j + 1) * page_size - 1, in the table's "
    "order, not in the order the pages lie in the pool"
)


def sorted_pages(table: list[int], page_size: int, k: mx.array, v: mx.array):
    """k, v [1, H, S, D] as a walk would see them that took the pages in sorted order: the
    positions of the table's entries, moved page by page (the slip this names)."""
    order = [table.index(page) for page in sorted(table)]  # which entry each read page is
    s, pad = k.shape[2], len(table) * page_size - k.shape[2]  # the last page's empty slots: 0
    positions = mx.array([j * page_size + i for j in order for i in range(page_size)][:s])
    return tuple(mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)])[:, :, positions] for x in (k, v))


def test_pages_are_read_in_page_table_order(impl):
    """Entry j of a page table holds positions j * P ..: reading the pages sorted by page number
    (the order they lie in the pool) shuffles the keys."""
    pool, caches, dense = fill_pool(impl, 4, [45, 17], seed=3)
    table = caches[0].page_table
    assert table != sorted(table), "test setup: the table must not be sorted"
    q = random_array((1, 4, 45, D), seed=21)
    got = impl.paged_attention(q, pool, [table], [45], block_size=8)
    close(got, oracle(q, *dense[0]), f"page table {table}: {IN_TABLE_ORDER}")


def test_stale_slots_of_a_reused_page_are_never_read(impl):
    """A request that reuses pages released by a longer one finds the old rows in the slots
    past its own length. Its last page is only partly its own: the walk must mask every slot
    at or after the request's length."""
    pool = impl.TinyKvPagedPool(2, D, page_size=8)
    old = impl.TinyKvPagedCache(pool)
    junk = random_array((1, 2, 32, D), seed=21, shift=50.0)
    old.append(junk, junk)
    old.release()
    new = impl.TinyKvPagedCache(pool)
    k, v = random_array((1, 2, 13, D), 22), random_array((1, 2, 13, D), 23)
    new.append(k, v)  # 13 tokens: slots 5..7 of its second page still hold the old request's
    assert pool.num_pages == 4 and set(new.page_table) <= set(range(4)), "pages were reused"
    for l in (1, 4):
        q = random_array((1, 4, l, D), seed=24)
        got = impl.paged_attention(q, pool, [new.page_table], [13], block_size=16)
        close(
            got,
            oracle(q, k, v),
            f"L={l}: slots past the request's 13 tokens hold another request's old rows; mask "
            "every key position >= the length (the causal mask from positions does it)",
        )


@pytest.mark.parametrize("l", [1, 3])
def test_paged_attention_reads_pages_in_place(impl, monkeypatch, l):
    """No array as long as the request (45 tokens, 12 pages of 4, 48 slots) is ever built: no
    gather, no concatenation of every page, no mask over every key."""
    pool, caches, dense = fill_pool(impl, 4, [45, 10])
    q = random_array((1, 4, l, D), seed=25)
    monkeypatch.setattr(pool, "gather", no_gather)
    spy = ShapeSpy(monkeypatch)
    got = impl.paged_attention(q, pool, [caches[0].page_table], [45], block_size=8)
    monkeypatch.undo()
    long = [x for x in spy.shapes if 45 in x or 48 in x]
    assert not long, (
        f"paged_attention built arrays of shapes {sorted(set(long))}, as long as the whole "
        "request (45 tokens in 48 slots): read a few pages per block straight from "
        "pool.key_pages / pool.value_pages with one indexing operation, never all of them"
    )
    close(got, oracle(q, *dense[0]), "with the spies installed")


def test_paged_attention_rejects_bad_arguments(impl):
    pool, caches, _ = fill_pool(impl, 4, [10])
    q = random_array((1, 4, 2, D), 0)
    table = caches[0].page_table
    with pytest.raises(ValueError):
        impl.paged_attention(q, pool, [table, table], [10, 10])  # 2 tables for 1 row
    with pytest.raises(ValueError):
        impl.paged_attention(q, pool, [table], [13])  # 3 pages of 4 hold at most 12
    with pytest.raises(ValueError):
        impl.paged_attention(random_array((1, 3, 2, D), 0), pool, [table], [10])
    got = impl.paged_attention(q, pool, [table], [10])
    assert got.shape == (1, 4, 2, D)


def test_paged_cache_attend_appends_then_reads_in_place(impl, monkeypatch):
    pool = impl.TinyKvPagedPool(2, D, page_size=4)
    pool.attention_block = 8
    other = impl.TinyKvPagedCache(pool)
    cache = impl.TinyKvPagedCache(pool)
    monkeypatch.setattr(pool, "gather", no_gather)
    k_all, v_all = random_array((1, 2, 23, D), 30), random_array((1, 2, 23, D), 31)
    start = 0
    for n in (6, 1, 9, 1, 1, 5):
        other.append(*random_kv_pair(n, seed=start))  # interleave another request's pages
        q = random_array((1, 4, n, D), seed=40 + start)
        k, v = k_all[:, :, start : start + n], v_all[:, :, start : start + n]
        got = cache.attend(q, k, v)
        start += n
        assert cache.offset == start, "attend appends the new rows: the offset grows by L"
        assert len(cache.page_table) == math.ceil(start / 4)
        want = oracle(q, k_all[:, :, :start], v_all[:, :, :start])
        close(got, want, f"attend with {n} new rows over {start} cached tokens")
    cache.release()
    other.release()
    assert pool.num_in_use == 0


def random_kv_pair(n, seed):
    return random_array((1, 2, n, D), seed + 500), random_array((1, 2, n, D), seed + 501)


# --- Task 4: batched decode over pages, and the model on the in-place path -----------------


def test_batched_decode_reads_each_row_over_its_own_pages(impl, monkeypatch):
    lengths = [13, 1, 30, 8]
    pool, caches, dense = fill_pool(impl, 4, lengths)
    pool.attention_block = 8
    batch = impl.BatchingKvCache(max_active_requests=5)
    for slot, cache in zip([0, 2, 3, 4], caches):
        batch.add_request(cache, slot)
    assert batch.reads_in_place, "every slot holds a paged cache of one pool"
    q = random_array((4, 4, 1, D), seed=50)
    k_new, v_new = random_array((4, 2, 1, D), 51), random_array((4, 2, 1, D), 52)
    monkeypatch.setattr(pool, "gather", no_gather)
    spy = ShapeSpy(monkeypatch)
    got = batch.attend(q, k_new, v_new)
    monkeypatch.undo()
    assert got.shape == (4, 4, 1, D)
    long = [x for x in spy.shapes if 31 in x or 32 in x]
    assert not long, (
        f"the batched decode built arrays of shapes {sorted(set(long))}, as long as the "
        "longest request (31 tokens, 32 slots): walk a padded page table a block at a time"
    )
    for b, ((k, v), cache) in enumerate(zip(dense, caches)):
        assert cache.offset == lengths[b] + 1, f"row {b}: its token is appended to its cache"
        k = mx.concatenate([k, k_new[b : b + 1]], axis=2)
        v = mx.concatenate([v, v_new[b : b + 1]], axis=2)
        close(
            got[b : b + 1],
            oracle(q[b : b + 1], k, v),
            f"row {b} ({lengths[b] + 1} tokens): each row sees only its own pages and its own "
            "length; a shorter row's padding pages must be masked",
        )


def test_batched_decode_on_a_full_pool_changes_nothing(impl):
    pool = impl.TinyKvPagedPool(2, D, page_size=4, max_pages=3)
    a, b = impl.TinyKvPagedCache(pool), impl.TinyKvPagedCache(pool)
    a.append(*random_kv_pair(4, 0))  # a's page is full: its next token needs a new page
    b.append(*random_kv_pair(8, 1))  # so is b's second page
    batch = impl.BatchingKvCache(2)
    batch.add_request(a, 0)
    batch.add_request(b, 1)
    before = (a.offset, list(a.page_table), b.offset, list(b.page_table), pool.num_in_use)
    q, (k, v) = random_array((2, 4, 1, D), 0), random_kv_pair(1, 2)
    with pytest.raises(impl.PagePoolExhausted):
        batch.attend(q, mx.concatenate([k, k]), mx.concatenate([v, v]))
    after = (a.offset, list(a.page_table), b.offset, list(b.page_table), pool.num_in_use)
    assert after == before, "a step the pool cannot hold must change no request"


def test_batching_cache_over_dense_caches_keeps_the_padded_path(impl, tiny_gqa_ckpt):
    model = impl.Qwen3Model(tiny_gqa_ckpt)
    caches = [model.create_kv_cache(), model.create_kv_cache()]
    batch = [impl.BatchingKvCache(2) for _ in range(model.num_hidden_layers)]
    for i, (cache, n) in enumerate(zip(caches, (5, 9))):
        model(mx.array([list(range(1, n + 1))]), 0, cache)
        for layer, layer_cache in zip(batch, cache):
            layer.add_request(layer_cache, i)
    assert not batch[0].reads_in_place, "dense caches have no pages to read in place"
    logits = model(mx.array([[7], [8]]), [5, 9], batch)
    for i, (n, token) in enumerate([(5, 7), (9, 8)]):
        alone = model.create_kv_cache()
        want = model(mx.array([list(range(1, n + 1)) + [token]]), 0, alone)[0, -1]
        close(logits[i, -1], want, f"row {i} over a dense cache", atol=1e-4, rtol=1e-4)


def small_block_pools(model, page_size):
    """Pools read in place, whose attention walk reads one page (or 8 slots) per block."""
    pools = model.create_kv_pools(page_size=page_size, read_in_place=True)
    for pool in pools:
        pool.attention_block = max(page_size, 8)
    return pools


PROMPT_TOKENS = 29
DECODE_STEPS = 4


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [1, 3, 7, PROMPT_TOKENS])
def test_chunked_prefill_over_pages_in_place_equals_one_shot(
    impl, model, tokenizer, monkeypatch, page_size, chunk
):
    """3.2's equality on the new path: chunked prefill and the decode steps after it, over paged
    caches read in place, give one-shot prefill's logits, and the pages are never gathered."""
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, PROMPT_TOKENS))
    dense = model.create_kv_cache()
    expected = model(mx.array([ids]), 0, dense)
    pools = small_block_pools(model, page_size)
    paged = model.create_paged_kv_cache(pools)
    monkeypatch.setattr(impl.TinyKvPagedPool, "gather", no_gather)
    pieces = [
        model(mx.array([ids[start : start + chunk]]), start, paged)
        for start in range(0, len(ids), chunk)
    ]
    close(
        mx.concatenate(pieces, axis=1),
        expected,
        f"chunks of {chunk} over pages of {page_size}: a chunk at offset s has queries at "
        "positions s .. s + L - 1; mask each block from those positions",
        atol=1e-4,
        rtol=1e-4,
    )
    token, offset = mx.argmax(expected[0, -1]).item(), len(ids)
    for step in range(DECODE_STEPS):
        want = model(mx.array([[token]]), offset, dense)
        got = model(mx.array([[token]]), offset, paged)
        close(got, want, f"decode step {step} after chunks of {chunk}", atol=1e-4, rtol=1e-4)
        token, offset = mx.argmax(want[0, -1]).item(), offset + 1
    release_all(paged)
    assert all(pool.num_in_use == 0 for pool in pools)


MAX_SEQ_LEN = 44


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Seven prompts of 1 to 30 tokens, more than the three slots of the runs below."""
    return [prompt_with_tokens(tokenizer, n) for n in (3, 9, 14, 22, 5, 30, 1)]


@pytest.fixture(scope="module")
def dense_texts(impl, model, tokenizer, prompts):
    return impl.batch_generate(model, tokenizer, prompts, MAX_SEQ_LEN, 3, 8)


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_batch_generate_over_pages_in_place(
    impl, tiny_gqa_ckpt, tokenizer, prompts, dense_texts, monkeypatch, policy, compiled
):
    """Batched decode (alternate), the ragged pass (hybrid) and the compiled blocks all read the
    pages in place and write what the dense caches write."""
    runner = impl.Qwen3Model(tiny_gqa_ckpt, compiled=compiled)
    pools = small_block_pools(runner, 4)
    monkeypatch.setattr(impl.TinyKvPagedPool, "gather", no_gather)
    batched = []
    module = importlib.import_module(f"{impl.__name__}.batching_kv_cache")
    real_attend = module.BatchingKvCache.attend

    def counted(self, *args):
        batched.append(len(self.active_slots))
        return real_attend(self, *args)

    monkeypatch.setattr(module.BatchingKvCache, "attend", counted)
    out = impl.batch_generate(
        runner, tokenizer, prompts, MAX_SEQ_LEN, 3, 8, pools=pools, policy=policy
    )
    assert out == dense_texts, f"{policy}, compiled={compiled}: texts differ from dense caches"
    if policy == "alternate":
        assert batched and max(batched) > 1, (
            "batched decode steps over paged caches must go through BatchingKvCache.attend"
        )
    assert all(pool.num_in_use == 0 for pool in pools), "every page returned"


# --- Task 5: the ragged pass over pages in place -------------------------------------------


def test_ragged_pass_in_place_equals_each_request_alone(impl, model, tokenizer):
    """Two decode rows and a chunk of 5 on top of 4 cached tokens in one ragged pass over a pool
    read in place: each segment's logits equal that request alone on a dense cache, and each
    cache grows by its own rows."""
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 30))
    pools = model.create_kv_pools(page_size=4, read_in_place=True)
    cached, new = [7, 12, 4], [1, 1, 5]
    caches = [model.create_paged_kv_cache(pools) for _ in cached]
    for cache, n in zip(caches, cached):
        model(mx.array([ids[:n]]), 0, cache)
    segments, tokens = [], []
    for cache, n, k in zip(caches, cached, new):
        segments.append(impl.Segment(cache, len(tokens), k))
        tokens += ids[n : n + k]
    logits = impl.forward_ragged(model, mx.array([tokens + [tokens[-1]] * 2]), segments)
    for i, (n, k) in enumerate(zip(cached, new)):
        want = model(mx.array([ids[: n + k]]), 0, model.create_kv_cache())[0, -1]
        assert_close(logits[0, i], want, f"segment {i} ({k} rows at offset {n}), pages in place")
        assert caches[i][0].offset == n + k, (
            f"segment {i}: reserve must advance its cache by its own {k} rows, no more"
        )
    for cache in caches:
        release_all(cache)
    assert pools[0].num_in_use == 0, "every page reserved is given back on release"


def decode_segments(impl, model, tokenizer, pools, cached):
    """One decode row per entry of `cached` (that many tokens already in its cache), side by
    side: (caches, segments, tokens [1, len(cached)])."""
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, max(cached) + 1))
    caches = [model.create_paged_kv_cache(pools) for _ in cached]
    for cache, n in zip(caches, cached):
        model(mx.array([ids[:n]]), 0, cache)
    segments = [impl.Segment(cache, j, 1) for j, cache in enumerate(caches)]
    return caches, segments, mx.array([[ids[n] for n in cached]])


def test_ragged_pass_writes_the_pool_in_place(impl, model, tokenizer):
    """Four decode rows over a pool read in place with room for 4096 pages: the pass must not
    copy a layer's pool. Writing a segment while an earlier segment's read of the pool is still
    pending makes MLX copy the whole pool for that write; writing every segment first (one
    scatter) and then attending lets the update reuse the pool's buffer."""
    pools = model.create_kv_pools(page_size=4, read_in_place=True)
    caches, segments, tokens = decode_segments(impl, model, tokenizer, pools, [6, 9, 13, 3])
    for pool in pools:
        pool._resize(4096)  # a large pool: a copy of it would dwarf everything else in the pass
    mx.eval(*(a for pool in pools for a in pool.storage))
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    logits = impl.forward_ragged(model, tokens, segments)
    mx.eval(logits, *(a for pool in pools for a in pool.storage))
    grew = mx.get_peak_memory() - before
    one_pool = pools[0].nbytes
    assert grew < one_pool / 2, (
        f"a ragged pass of 4 decode rows took {grew / 2**20:.1f} MiB at its peak, against "
        f"{one_pool / 2**20:.1f} MiB for one layer's pool: the pool was copied. Write every "
        "segment's keys/values first (one scatter per layer), then attend: a write while a "
        "read of the pool is pending cannot happen in place"
    )
    for cache in caches:
        release_all(cache)


def test_ragged_pass_attends_decode_rows_in_one_call(impl, model, tokenizer, monkeypatch):
    """Over a pool read in place, every decode row of a layer goes through one paged_attention
    call (3.5's batched decode), and a prompt chunk through a call of its own: 2 calls a layer
    for 3 decode rows and a chunk, not 4."""
    module = importlib.import_module(f"{impl.__name__}.stall_free")
    calls = []

    def spy(query, *args, **kwargs):
        calls.append(query.shape[0])
        return real(query, *args, **kwargs)

    real = module.paged_attention
    monkeypatch.setattr(module, "paged_attention", spy)
    pools = model.create_kv_pools(page_size=4, read_in_place=True)
    caches, segments, tokens = decode_segments(impl, model, tokenizer, pools, [6, 9, 13])
    chunk = model.create_paged_kv_cache(pools)
    segments.append(impl.Segment(chunk, 3, 4))
    tokens = mx.concatenate([tokens, mx.array([[5, 6, 7, 8]])], axis=1)
    mx.eval(impl.forward_ragged(model, tokens, segments))
    layers = len(model.layers)
    assert sorted(calls) == [1] * layers + [3] * layers, (
        f"paged_attention was called with batches of {sorted(calls)} rows over {layers} layers; "
        "expected one call of 3 decode rows and one of the chunk per layer: group the "
        "segments by length and attend each group in one call"
    )
    for cache in caches + [chunk]:
        release_all(cache)

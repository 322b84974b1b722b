"""Week 2 Day 2: the paged KV cache (page pool, page table, release and reuse).

The oracle for the paged cache is the dense cache of Day 1: the same model decoding with
either one must give the same logits at every step.
"""

import math
import re

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_all_pages_free

ATOL = RTOL = 1e-4
H_KV, D = 2, 4


def assert_close(actual: mx.array, expected: mx.array, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(
        np.array(actual), np.array(expected), atol=ATOL, rtol=RTOL, err_msg=what
    )


def random_kv(length: int, seed: int, heads: int = H_KV, dim: int = D):
    """key/value [1, heads, length, dim]"""
    rng = np.random.RandomState(seed)
    shape = (1, heads, length, dim)
    k = mx.array(rng.standard_normal(shape).astype(np.float32))
    v = mx.array(rng.standard_normal(shape).astype(np.float32))
    return k, v


def state(pool, **caches) -> dict:
    """Everything a refused request must leave as it was, by name: the pool's counters and free
    list, and each named cache's offset and page table."""
    names = ["num_pages", "num_in_use", "free_pages", "num_allocations", "peak_in_use"]
    found = {f"pool.{name}": copy(getattr(pool, name)) for name in names}
    for name, cache in caches.items():
        found[f"{name}.offset"] = cache.offset
        found[f"{name}.page_table"] = list(cache.page_table)
    return found


def copy(value):
    return list(value) if isinstance(value, list) else value


def pages_of(pool) -> dict:
    return {"num_pages": pool.num_pages, "num_in_use": pool.num_in_use, "free": pool.free_pages}


def assert_unchanged(before: dict, after: dict, why: str) -> None:
    changed = [f"{k}: {before[k]} -> {after[k]}" for k in before if before[k] != after[k]]
    assert not changed, f"{why}, but it changed " + "; ".join(changed)


# --- Task 1: the pool's pages --------------------------------------------------------------


def test_pool_allocates_frees_and_reuses(impl):
    with pytest.raises(ValueError):
        impl.TinyKvPagedPool(H_KV, D, page_size=0)
    with pytest.raises(ValueError):
        impl.TinyKvPagedPool(H_KV, D, max_pages=0)
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=4)
    pages = [pool.allocate() for _ in range(3)]
    assert sorted(pages) == [0, 1, 2], "a new page gets the next physical index"
    assert pool.capacity >= pool.num_pages, (
        f"{pool.num_pages} pages made, room for {pool.capacity} in the storage arrays: allocate "
        "must call self._grow() when num_pages reaches capacity"
    )
    after_three = {"num_pages": 3, "num_in_use": 3, "free": []}
    assert pages_of(pool) == after_three, "three new pages, all in use, none free"
    assert pool.key_pages[0].shape == pool.value_pages[0].shape == (H_KV, 4, D), (
        "a page is [num_kv_heads, page_size, head_dim], for keys and for values"
    )
    assert pool.key_pages[0].dtype == mx.float32, "a page has the pool's dtype"
    for storage in (pool.key_pages, pool.value_pages):  # one array per layer, page i at [i]
        assert isinstance(storage, mx.array) and storage.shape[1:] == (H_KV, 4, D), (
            "the pool keeps one [pages, num_kv_heads, page_size, head_dim] array for keys and "
            "one for values (Week 3 Day 5 reads pages in place from them)"
        )
        assert storage.shape[0] >= pool.num_pages, "the storage has a row for every page made"
    pool.free(pages[1])
    assert pages_of(pool) == {"num_pages": 3, "num_in_use": 2, "free": [pages[1]]}, (
        "free() puts the page on the free list; the page itself still exists (num_pages)"
    )
    assert pool.allocate() == pages[1], "a freed page is reused before a new one is made"
    assert pages_of(pool) == after_three, "reusing a page takes it off the free list"
    assert pool.allocate() == 3, "with no free page, a new page gets the next index"
    assert pool.num_pages == 4, "num_pages counts every page made"


def test_pool_free_rejects_free_and_foreign_pages(impl):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=2)
    page = pool.allocate()
    pool.allocate()
    pool.free(page)
    with pytest.raises(ValueError):
        pool.free(page)  # already free
        pytest.fail(f"free({page}) of a page already free must raise ValueError")
    for foreign in (2, 100, -1):
        with pytest.raises(ValueError):
            pool.free(foreign)  # never handed out by this pool
            pytest.fail(f"free({foreign}) of a page this pool never made must raise ValueError")
    assert pool.free_pages == [page], "a rejected free changes nothing"
    assert pool.num_in_use == 1, "a rejected free changes nothing"


def test_pool_capacity(impl):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=2, max_pages=3)
    fits = lambda: [n for n in range(6) if pool.can_allocate(n)]
    assert fits() == [0, 1, 2, 3], "an empty pool of max_pages=3 can hand out 0 to 3 pages"
    a, b = pool.allocate(), pool.allocate()
    assert fits() == [0, 1], "two pages in use of 3: one more fits"
    pool.free(a)
    assert fits() == [0, 1, 2], "one free page plus one page not made yet"
    pool.allocate()
    pool.allocate()
    assert fits() == [0], "all 3 pages in use"
    before = state(pool)
    with pytest.raises(impl.PagePoolExhausted):
        pool.allocate()
    assert_unchanged(before, state(pool), "a refused allocation must change nothing")
    pool.free(b)
    assert pool.allocate() == b, "the freed page is the one handed out again"
    unlimited = impl.TinyKvPagedPool(H_KV, D, page_size=2)
    assert unlimited.can_allocate(10_000), "max_pages=None: any number of pages fits"


def test_pool_counters(impl):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=2)
    counters = lambda: {k: getattr(pool, k) for k in ("num_allocations", "peak_in_use")}
    assert counters() == {"num_allocations": 0, "peak_in_use": 0}, "a new pool has counted nothing"
    pages = [pool.allocate() for _ in range(4)]
    assert counters() == {"num_allocations": 4, "peak_in_use": 4}, "four pages handed out"
    for page in pages[:3]:
        pool.free(page)
    assert counters() == {"num_allocations": 4, "peak_in_use": 4}, (
        "free() counts no allocation and keeps the peak"
    )
    pool.allocate()
    pool.allocate()
    assert pool.num_allocations == 6, "a reused page counts as a new allocation"
    assert (pool.peak_in_use, pool.num_in_use) == (4, 3), "3 pages in use, below the peak of 4"
    pool.allocate()
    pool.allocate()
    assert (pool.peak_in_use, pool.num_pages) == (5, 5), "the peak follows num_in_use up"


# --- Task 2: write and gather --------------------------------------------------------------


def test_write_and_gather_follow_the_page_table(impl):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=3)
    for _ in range(4):
        pool.allocate()
    k, v = random_kv(8, seed=0)
    k, v = k[0], v[0]  # [H_kv, 8, D]
    table = [2, 0, 3]  # logical page i lives in physical page table[i]
    pool.write(2, 0, k[:, 0:2], v[:, 0:2])  # a page filled in two writes
    pool.write(2, 2, k[:, 2:3], v[:, 2:3])
    pool.write(0, 0, k[:, 3:6], v[:, 3:6])
    pool.write(3, 0, k[:, 6:8], v[:, 6:8])  # the last page is not full
    assert_close(pool.key_pages[0], k[:, 3:6], "physical page 0 holds logical page 1")
    assert_close(pool.value_pages[2], v[:, 0:3], "physical page 2 holds logical page 0")
    for length in (8, 7, 3, 1):
        keys, values = pool.gather(table, length)
        assert_close(keys, k[:, :length], f"gathered keys, length {length}")
        assert_close(values, v[:, :length], f"gathered values, length {length}")
    keys, values = pool.gather([0, 2], 5)  # another order, another request's view
    assert_close(keys, mx.concatenate([k[:, 3:6], k[:, 0:2]], axis=1))
    assert_close(values, mx.concatenate([v[:, 3:6], v[:, 0:2]], axis=1))


# --- Task 3: append through the page table -------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_appends_across_page_boundaries(impl, page_size):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=page_size)
    cache = impl.TinyKvPagedCache(pool)
    assert (cache.offset, cache.page_table) == (0, []), "a new cache holds nothing"
    all_k, all_v = [], []
    for i, length in enumerate([5, 1, 1, 7, 2, 16, 1, 3]):
        k, v = random_kv(length, seed=i)
        all_k.append(k)
        all_v.append(v)
        keys, values, mask = cache.update_and_fetch(k, v)
        s = sum(x.shape[2] for x in all_k)
        assert cache.offset == s, "the offset advances by exactly the rows appended"
        assert len(cache.page_table) == math.ceil(s / page_size), "no page more than needed"
        assert len(set(cache.page_table)) == len(cache.page_table), "a page listed twice"
        assert pool.num_in_use == len(cache.page_table), "every page in use is in the table"
        assert mask is None, "a paged cache has no mask of its own: return None"
        assert keys.shape == values.shape == (1, H_KV, s, D), "keys/values: [1, H_kv, S, D]"
        assert_close(keys, mx.concatenate(all_k, axis=2), f"keys after {s} rows")
        assert_close(values, mx.concatenate(all_v, axis=2), f"values after {s} rows")


def test_two_requests_share_a_pool(impl):
    """Interleaved appends leave each request's pages scattered through the pool."""
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=2)
    a, b = impl.TinyKvPagedCache(pool), impl.TinyKvPagedCache(pool)
    ka, kb = [], []
    for i in range(7):
        for cache, store, seed in ((a, ka, i), (b, kb, 100 + i)):
            k, v = random_kv(1 + i % 2, seed)
            store.append(k)
            keys, _, _ = cache.update_and_fetch(k, v)
            assert_close(keys, mx.concatenate(store, axis=2), "one request's rows only")
    assert not set(a.page_table) & set(b.page_table), "no page is shared"
    assert pool.num_in_use == len(a.page_table) + len(b.page_table), "a page in use by nobody"
    assert sorted(a.page_table + b.page_table) == list(range(pool.num_pages)), (
        "the two page tables together should hold every page the pool made"
    )
    assert max(a.page_table) - min(a.page_table) >= len(a.page_table), "the pages interleave"


def test_rejects_bad_shapes_and_dtypes_before_allocating(impl):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=4)
    cache = impl.TinyKvPagedCache(pool)
    k, v = random_kv(3, seed=0)
    bad = [
        (mx.zeros((2, H_KV, 3, D)), mx.zeros((2, H_KV, 3, D))),  # batch of 2
        (mx.zeros((1, H_KV + 1, 3, D)), mx.zeros((1, H_KV + 1, 3, D))),  # head count
        (mx.zeros((1, H_KV, 3, D + 1)), mx.zeros((1, H_KV, 3, D + 1))),  # head_dim
        (k, v[:, :, :2]),  # key and value lengths differ
        (k.astype(mx.float16), v.astype(mx.float16)),  # the pool stores float32
        (k, v.astype(mx.bfloat16)),
    ]
    for key, value in bad:
        with pytest.raises(ValueError):
            cache.update_and_fetch(key, value)
        assert pool.num_allocations == 0 and pool.num_pages == 0, (
            "a refused key/value allocated a page: call _check before allocating"
        )
        assert (cache.offset, cache.page_table) == (0, []), "a refused append changed the cache"
    keys, _, _ = cache.update_and_fetch(k, v)
    assert_close(keys, k)
    before = state(pool, cache=cache)
    with pytest.raises(ValueError):
        cache.update_and_fetch(mx.zeros((1, H_KV, 9, D + 1)), mx.zeros((1, H_KV, 9, D + 1)))
    assert_unchanged(before, state(pool, cache=cache), "a refused append must change nothing")


def test_exhausted_pool_changes_nothing(impl):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=4, max_pages=4)
    a, b = impl.TinyKvPagedCache(pool), impl.TinyKvPagedCache(pool)
    a.update_and_fetch(*random_kv(6, seed=0))  # 2 pages, 2 slots left in the last one
    b.update_and_fetch(*random_kv(1, seed=1))  # 1 page
    # 9 more rows for b need 2 more pages; only 1 is left. Not even that one may be taken.
    before = state(pool, a=a, b=b)
    with pytest.raises(impl.PagePoolExhausted) as refused:
        b.update_and_fetch(*random_kv(9, seed=2))
    assert re.search(r"\b2\b", str(refused.value)), (
        f"PagePoolExhausted said {str(refused.value)!r}: the message must say how many pages the "
        "append needed (2)"
    )
    assert_unchanged(
        before,
        state(pool, a=a, b=b),
        "an append that needs 2 pages when 1 is left must take none (ask can_allocate for all "
        "of them first) and leave offset and page table alone",
    )
    b.update_and_fetch(*random_kv(7, seed=3))  # 8 rows: b takes the last page
    assert pool.num_in_use == 4 and not pool.can_allocate(1), "b took the last of the 4 pages"
    a_pages = list(a.page_table)
    a.update_and_fetch(*random_kv(2, seed=4))  # fits in a's last page: no page needed
    assert (a.offset, a.page_table) == (8, a_pages), (
        "2 rows fit in the free slots of a's last page: no new page is needed, even when the "
        "pool is full"
    )
    before = state(pool, a=a, b=b)
    with pytest.raises(impl.PagePoolExhausted):
        a.update_and_fetch(*random_kv(1, seed=5))
    assert_unchanged(before, state(pool, a=a, b=b), "a refused append must change nothing")
    keys, values = pool.gather(a.page_table, a.offset)  # a's rows are intact
    assert_close(keys[None], mx.concatenate([random_kv(6, 0)[0], random_kv(2, 4)[0]], axis=2))
    assert_close(values[None], mx.concatenate([random_kv(6, 0)[1], random_kv(2, 4)[1]], axis=2))


# --- Task 4: release and reuse -------------------------------------------------------------


def test_release_returns_every_page_and_they_are_reused(impl, monkeypatch):
    pool = impl.TinyKvPagedPool(H_KV, D, page_size=3)
    first = impl.TinyKvPagedCache(pool)
    first.update_and_fetch(*random_kv(10, seed=0))
    first.update_and_fetch(*random_kv(4, seed=1))
    pages = set(first.page_table)
    assert len(pages) == 5 and pool.num_in_use == 5, "14 rows in pages of 3: 5 pages"
    table, freed, free = list(first.page_table), [], pool.free
    with monkeypatch.context() as watch:  # the order release() frees in
        watch.setattr(pool, "free", lambda page: freed.append(page) or free(page))
        first.release()
    assert freed == table[::-1], (
        f"release() freed the pages in the order {freed}, the page table is {table}: free the "
        "last page first (Week 4 Day 4's cached pages rely on it)"
    )
    assert (first.offset, first.page_table) == (0, []), (
        "release() empties the page table and resets the offset to 0"
    )
    assert_all_pages_free([pool], "release() must free every page in the page table")
    assert sorted(pool.free_pages) == list(range(pool.num_pages)) == sorted(pages), (
        "the free list should hold exactly the released pages"
    )
    first.release()  # safe to call twice
    assert len(pool.free_pages) == 5, (
        "a second release() has nothing left to free: it must not free a page again"
    )
    second = impl.TinyKvPagedCache(pool)
    k, v = random_kv(14, seed=2)
    keys, values, _ = second.update_and_fetch(k, v)
    assert set(second.page_table) == pages, "the next request reuses the same physical pages"
    assert pool.num_pages == 5, "no new page was made"
    assert (pool.num_allocations, pool.peak_in_use) == (10, 5), "5 pages handed out twice"
    assert_close(keys, k, "nothing of the first request shows through")
    assert_close(values, v)


# --- the model over paged caches -----------------------------------------------------------


def decode_paged(model, paged, tokens: list[int], steps: int) -> tuple[list[int], mx.array]:
    """Prefill `tokens` into the paged caches, then decode greedily one token per step.
    Returns every token fed and the logits at every position [1, len(tokens) + steps, V]."""
    logits = [model(mx.array([tokens]), 0, paged)]  # [1, P, V]
    tokens = list(tokens)
    for _ in range(steps):
        token = int(mx.argmax(logits[-1][0, -1]).item())
        logits.append(model(mx.array([[token]]), len(tokens), paged))  # [1, 1, V]
        tokens.append(token)
    return tokens, mx.concatenate(logits, axis=1)


def assert_matches_dense(model, tokens: list[int], paged_logits: mx.array, what: str) -> None:
    """The dense cache of Day 1 on the whole sequence gives every position's logits at once;
    they must equal what the paged cache gave at each decode step."""
    dense_logits = model(mx.array([tokens]), 0, model.create_kv_cache())
    for pos in range(dense_logits.shape[1]):
        assert_close(paged_logits[:, pos], dense_logits[:, pos], f"{what}: position {pos}")


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_logits_match_dense_over_64_steps(impl, tiny_ckpt, page_size):
    model = impl.Qwen3Model(tiny_ckpt)
    pools = model.create_kv_pools(page_size=page_size)
    paged = model.create_paged_kv_cache(pools)
    prompt = tiny_ckpt.tokenizer.encode("Pages of keys, pages of values.")
    tokens, logits = decode_paged(model, paged, prompt, 64)
    assert_matches_dense(model, tokens, logits, f"page size {page_size}")
    total = len(tokens)
    pages = math.ceil(total / page_size)
    for layer, (pool, layer_cache) in enumerate(zip(pools, paged)):
        assert layer_cache.offset == total, f"layer {layer}: offset after {total} tokens"
        assert len(layer_cache.page_table) == pages, f"layer {layer}: {total} tokens need {pages}"
        assert pool.num_pages == pool.num_in_use == pages, f"layer {layer}: a page too many"


def test_paged_model_after_release_reuses_pages(impl, tiny_gqa_ckpt):
    """A second request on the same pools, after the first released its pages, decodes
    exactly as it would on fresh dense caches: stale page contents never leak in."""
    model = impl.Qwen3Model(tiny_gqa_ckpt)
    pools = model.create_kv_pools(page_size=4)
    first = model.create_paged_kv_cache(pools)
    tokens, logits = decode_paged(model, first, list(range(40, 60)), 8)
    assert_matches_dense(model, tokens, logits, "first request")
    used = [pool.num_pages for pool in pools]
    for layer_cache in first:
        layer_cache.release()
    assert_all_pages_free(pools, "release() on every layer must free every page")
    second = model.create_paged_kv_cache(pools)
    tokens, logits = decode_paged(model, second, list(range(70, 79)), 6)
    assert_matches_dense(model, tokens, logits, "second request")
    assert [pool.num_pages for pool in pools] == used, "the second request made no new page"

"""Week 4 Day 4: prefix caching. Full pages shared by content.

Task 1  page_key, TinyKvSharedPool.lookup / register, register_full_pages: a full page is found
        by a key chained from the entry before it, confirmed by its tokens and that entry; a
        page is registered as it fills, prompt and generated tokens alike.
Task 2  TinyKvSharedPool.allocate / hold / free: reference counts; a page no table holds is
        cached on an LRU; allocation takes free pages first, then the least recently used
        cached page; a page in use is never evicted.
Task 3  cached_prefix, reuse_prefix: on admission the page tables start with the cached pages
        and prefill starts after them; the last prompt token is always computed.
Task 4  tokens_to_admit: admission counts only the pages a prompt takes anew.

Oracles: the same engine with the prefix cache off (plain pools), token for token; the KV
cached loop of 2.1 one prompt at a time; the events the scheduler reports (on_step).
"""

import importlib
import random

import pytest
from helpers import assert_all_pages_free, serve_greedy

MAX_SEQ_LEN = 96
PAGE = 4


def module(impl):
    return importlib.import_module(f"{impl.__name__}.prefix_cache")


def shared_pool(impl, max_pages=None):
    return impl.TinyKvSharedPool(num_kv_heads=1, head_dim=8, page_size=PAGE, max_pages=max_pages)


def pool_and_pages(impl, n):
    """A fresh shared pool and n pages allocated from it."""
    pool = shared_pool(impl)
    return pool, [pool.allocate() for _ in range(n)]


def ids(*values):
    return tuple(values)


# --- Task 1: keys, lookup, registration ------------------------------------------------------


def test_a_key_depends_on_the_entry_before_the_page(impl):
    key = module(impl).page_key
    root = module(impl).ROOT
    assert key(root, ids(1, 2, 3, 4)) == key(root, ids(1, 2, 3, 4)), "a key is a pure function"
    assert key(root, ids(1, 2, 3, 4)) != key(5, ids(1, 2, 3, 4)), (
        "the same tokens after a different prefix must get another key: their keys and values "
        "differ (RoPE turned them by another position, attention mixed in other tokens)"
    )
    assert key(root, ids(1, 2, 3, 4)) != key(root, ids(1, 2, 3, 5)), "other tokens, other key"


def test_a_registered_page_is_found_by_its_content_only(impl):
    root = module(impl).ROOT
    pool, (a, b) = pool_and_pages(impl, 2)
    first = pool.register(a, root, ids(1, 2, 3, 4))
    second = pool.register(b, first, ids(5, 6, 7, 8))
    found = pool.lookup(root, ids(1, 2, 3, 4))
    assert found is not None and found.page == a and found.entry == first, (
        "lookup(ROOT, tokens) must find the page registered with those tokens first in a prompt"
    )
    assert pool.lookup(first, ids(5, 6, 7, 8)).page == b
    assert pool.lookup(root, ids(5, 6, 7, 8)) is None, (
        "a page registered after entry `first` must not be found as a prompt's first page"
    )
    assert pool.lookup(root, ids(1, 2, 3, 9)) is None, "other tokens must miss"
    assert first != second, "every registered page gets its own entry id"


def test_the_same_content_registered_twice_keeps_the_first_page(impl):
    root = module(impl).ROOT
    pool, (a, b) = pool_and_pages(impl, 2)
    first = pool.register(a, root, ids(1, 2, 3, 4))
    again = pool.register(b, root, ids(1, 2, 3, 4))
    assert again == first, (
        "a page with content the index already holds (two prompts prefilled the same prefix at "
        "once) must return the existing entry, so the request's next pages chain through it"
    )
    assert pool.lookup(root, ids(1, 2, 3, 4)).page == a
    pool.free(b)
    assert pool.num_in_use == 1, (
        f"free of a page one table holds must drop that reference: {pool.num_in_use} pages in "
        "use after freeing one of two (free decrements refs[page] and forgets it at 0)"
    )
    assert pool.num_cached == 0, (
        "the second copy was never indexed: freeing it returns it to the free list, not the LRU"
    )


def test_a_hash_collision_is_a_miss(impl, monkeypatch):
    mod = module(impl)
    monkeypatch.setattr(mod, "page_key", lambda parent, tokens: 12345)  # every page collides
    pool, (a, b) = pool_and_pages(impl, 2)
    first = pool.register(a, mod.ROOT, ids(1, 2, 3, 4))
    assert pool.lookup(mod.ROOT, ids(9, 9, 9, 9)) is None, (
        "two different token pages with the same key: lookup must compare the stored token ids "
        "and return None, never the other prompt's page"
    )
    assert pool.lookup(first, ids(1, 2, 3, 4)) is None, (
        "same tokens, same key, but after another entry: lookup must compare the parent entry"
    )
    other = pool.register(b, mod.ROOT, ids(9, 9, 9, 9))
    assert other != first, "a page whose key is taken by other content gets a fresh entry"
    assert pool.lookup(mod.ROOT, ids(9, 9, 9, 9)) is None
    found = pool.lookup(mod.ROOT, ids(1, 2, 3, 4))
    assert found is not None and found.page == a, (
        "the first content stays findable under the one key every page gets here (a miss: "
        "lookup or register call hash(...) inline instead of page_key)"
    )


def test_an_entry_is_never_handed_out_twice(impl):
    """Entries name contents, not pages: after page a is evicted and refilled with other
    content, that content gets a new entry, and the page registered after a's old content
    (entry x) is not found after the new one."""
    root = module(impl).ROOT
    pool = shared_pool(impl, max_pages=2)
    a, b = pool.allocate(), pool.allocate()
    x = pool.register(a, root, ids(1, 1, 1, 1))
    t = pool.register(b, x, ids(2, 2, 2, 2))
    pool.free(a)
    pool.free(b)  # both cached: a is the least recently used
    assert pool.allocate() == a, "the least recently used cached page is evicted (setup)"
    y = pool.register(a, root, ids(3, 3, 3, 3))
    assert y not in (x, t), (
        f"page {a}'s new content got entry {y}, already handed out ({x} and {t} were): an entry "
        "must never be reused, not even after its page was evicted (count entries handed out; "
        "the index's size or the page number repeat)"
    )
    assert pool.lookup(y, ids(2, 2, 2, 2)) is None, (
        f"lookup after the new content of page {a} found the page registered after its old "
        "content: the parent must be the entry of the content before, never its page number"
    )


# --- Task 2: reference counts and the LRU ---------------------------------------------------


def test_a_page_no_table_holds_stays_cached_until_an_allocation_needs_it(impl):
    root = module(impl).ROOT
    pool = shared_pool(impl, max_pages=3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.num_in_use == 3 and not pool.can_allocate(1)
    pool.register(a, root, ids(1, 1, 1, 1))
    pool.register(b, root, ids(2, 2, 2, 2))
    pool.free(a)
    pool.free(b)
    pool.free(c)  # never registered: back on the free list
    assert pool.num_in_use == 0 and pool.num_cached == 2, (
        "a registered page that no page table holds is cached (counted by num_cached, not by "
        "num_in_use); an unregistered one is free"
    )
    assert pool.can_allocate(3), "cached pages count as free: an allocation can evict them"
    assert pool.lookup(root, ids(1, 1, 1, 1)).page == a, "a cached page can still be found"
    assert pool.allocate() == c, "allocation must take a free page before evicting a cached one"
    handed_out = pool.num_allocations
    assert pool.allocate() == a, "then the least recently used cached page (a was freed first)"
    assert pool.num_allocations == handed_out + 1, (
        "an evicted page handed out again counts in num_allocations like a free one"
    )
    assert pool.lookup(root, ids(1, 1, 1, 1)) is None, "an evicted page leaves the index"
    assert pool.lookup(root, ids(2, 2, 2, 2)).page == b


def test_peak_in_use_counts_pages_however_a_table_took_them(impl):
    """peak_in_use: the most pages page tables held at once, whether a page came free, was
    evicted from the LRU or was taken cached (hold): each path updates it."""
    root = module(impl).ROOT
    pool, (a, b) = pool_and_pages(impl, 2)
    assert pool.peak_in_use == 2, f"two pages allocated: peak_in_use {pool.peak_in_use}, want 2"
    pool.register(a, root, ids(1, 1, 1, 1))
    pool.register(b, root, ids(2, 2, 2, 2))
    pool.free(a)
    pool.free(b)  # both cached, none in use
    pool.allocate()
    pool.hold(a)
    pool.hold(b)
    assert pool.num_in_use == 3 and pool.peak_in_use == 3, (
        f"a new page and two cached pages taken with hold(): peak_in_use {pool.peak_in_use}, "
        "want 3 (update it in hold too; and allocate must make a new page while the pool has "
        "room, not evict a cached one)"
    )
    small = shared_pool(impl, max_pages=2)
    c = small.allocate()
    small.register(c, root, ids(3, 3, 3, 3))
    small.free(c)  # cached
    small.allocate()  # the free page
    small.allocate()  # evicts c
    assert small.peak_in_use == 2, (
        f"a free page, then one evicted from the LRU: peak_in_use {small.peak_in_use}, want 2 "
        "(update it on the eviction path of allocate too)"
    )


def test_a_held_page_is_never_evicted(impl):
    root = module(impl).ROOT
    pool = shared_pool(impl, max_pages=2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, root, ids(1, 1, 1, 1))
    pool.free(a)
    pool.hold(a)  # a second request's page table takes it again
    assert pool.num_in_use == 2 and pool.num_cached == 0, "hold() takes a page off the LRU"
    with pytest.raises(impl.PagePoolExhausted):
        pool.allocate()
    assert pool.lookup(root, ids(1, 1, 1, 1)).page == a, "a page in use was evicted"
    pool.hold(a)  # two tables hold it
    pool.free(a)
    assert pool.num_in_use == 2, "a page two tables hold is still in use after one lets go"
    pool.free(a)
    pool.free(b)
    assert pool.num_in_use == 0 and pool.num_cached == 1
    with pytest.raises(ValueError, match="page"):
        pool.free(b)  # no table holds it any more


def test_hold_moves_a_page_to_the_recent_end(impl):
    root = module(impl).ROOT
    pool = shared_pool(impl, max_pages=2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, root, ids(1, 1, 1, 1))
    pool.register(b, root, ids(2, 2, 2, 2))
    pool.free(a)
    pool.free(b)
    pool.hold(a)
    pool.free(a)  # a is now more recently used than b
    assert pool.allocate() == b, "the least recently used cached page goes first"


# --- Tasks 1 and 3: the engine with the cache on ---------------------------------------------


def chat(rng, n):
    return [rng.randrange(3, 200) for _ in range(n)]


def engine_for(impl, model, tokenizer, prefix_cache, policy, max_pages=None, **kwargs):
    pools = model.create_kv_pools(page_size=PAGE, max_pages=max_pages, prefix_cache=prefix_cache)
    events = []
    settings = dict(max_seq_len=MAX_SEQ_LEN, batch_size=3, prefill_step=8, on_step=events.append)
    settings.update(kwargs)
    engine = impl.Engine(model, tokenizer, pools=pools, policy=policy, **settings)
    return engine, pools, events


def conversation(impl, model, tokenizer, prefix_cache, policy, turns, max_tokens=5, **kwargs):
    """Each turn re-sends the conversation so far (every earlier prompt and answer) plus a new
    message. Returns the answers per turn, the events and the pools."""
    engine, pools, events = engine_for(impl, model, tokenizer, prefix_cache, policy, **kwargs)
    history, answers = [], []
    for message in turns:
        history = history + message
        [answer] = serve_greedy(engine, [history], max_tokens).values()
        answers.append(answer)
        history = history + answer
    return answers, events, pools


def prefilled(events):
    return sum(e.tokens for e in events if e.kind == "prefill")


def cached(events):
    return [e.tokens for e in events if e.kind == "admit"]


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_a_shared_system_prompt_is_prefilled_once(impl, model, tokenizer, policy):
    rng = random.Random(1)
    system = chat(rng, 21)  # 5 full pages and 1 token
    prompts = [system + chat(rng, 3 + i) for i in range(4)]
    runs = {}
    for on in (False, True):
        engine, pools, events = engine_for(impl, model, tokenizer, on, policy, batch_size=1)
        runs[on] = (serve_greedy(engine, prompts, 6, check=check_counts), events, pools)
    (off, off_events, _), (got, events, pools) = runs[False], runs[True]
    assert got == off, (
        f"{policy}: texts differ with the prefix cache on: a request started from the cached "
        "pages must attend to them at its absolute offset, exactly as if it had prefilled them"
    )
    assert cached(events) == [0, 20, 20, 20], (
        f"{policy}: tokens found in the cache at each admission were {cached(events)}: with one "
        "slot each prompt runs alone, after the one before has registered the 5 full pages of "
        "the 21-token system prompt"
    )
    assert prefilled(events) == prefilled(off_events) - 60, (
        "prefill must start at the first token after the cached pages: "
        f"{prefilled(off_events)} tokens prefilled without the cache, {prefilled(events)} with "
        "it, 60 found cached"
    )
    assert_all_pages_free(pools, f"{policy}: every request has ended")


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_the_next_turn_of_a_chat_finds_the_previous_answer(impl, model, tokenizer, policy):
    rng = random.Random(2)
    turns = [chat(rng, 10), chat(rng, 5), chat(rng, 7)]
    off, off_events, _ = conversation(impl, model, tokenizer, False, policy, turns)
    got, events, pools = conversation(impl, model, tokenizer, True, policy, turns)
    assert got == off, f"{policy}: the answers differ with the prefix cache on"
    # what the cache held after turn k: its prompt and every answer token but the last
    held = [10 + 5 - 1, 10 + 5 + 5 + 7 - 1]
    want = [0] + [n // PAGE * PAGE for n in held]
    assert cached(events) == want, (
        f"{policy}: each turn found {cached(events)} tokens cached, expected {want}: the pages "
        "that decode filled must be registered as they fill (register_full_pages after every "
        "decode step), so that the next turn finds the answer too"
    )
    assert_all_pages_free(pools, f"{policy}: the chat has ended")


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("length", [8, 9, 11])
def test_the_last_prompt_token_is_always_computed(impl, model, tokenizer, policy, length):
    prompt = chat(random.Random(length), length)
    runs = {}
    for on in (False, True):
        engine, pools, events = engine_for(impl, model, tokenizer, on, policy, batch_size=1)
        runs[on] = (serve_greedy(engine, [prompt, prompt, prompt[:length]], 4), events)
    assert runs[True][0] == runs[False][0], "an identical prompt must generate the same tokens"
    want = (length - 1) // PAGE * PAGE
    assert cached(runs[True][1])[1:] == [want, want], (
        f"a repeated {length}-token prompt found {cached(runs[True][1])[1:]} tokens cached, "
        f"expected {want}: match at most len(prompt) - 1 tokens, so the last prompt token is "
        "computed and its logits give the first generated token (a prompt that ends on a page "
        "boundary leaves its last page to prefill)"
    )


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("kv_bits", [None, 8])
def test_small_pools_evict_and_preempt_and_keep_the_texts(
    impl, model, tokenizer, tiny_gqa_ckpt, policy, kv_bits
):
    if kv_bits:  # INT8 pages in groups of 32: the tiny model's head_dim is 32
        model = impl.Qwen3Model(tiny_gqa_ckpt, kv_bits=8, kv_group_size=32)
    rng = random.Random(3)
    system = chat(rng, 13)
    prompts = [system[: 5 + 4 * (i % 3)] + chat(rng, 4 + i) for i in range(7)]
    prompts += [prompts[1], prompts[4] + chat(rng, 3)]
    budgets = [8, 3, 10, 5, 7, 12, 4, 6, 9]
    runs = {}
    for on in (False, True):
        engine, pools, events = engine_for(
            impl, model, tokenizer, on, policy, max_pages=14, batch_size=3
        )
        runs[on] = serve_greedy(engine, prompts, budgets, check=check_counts), events, pools
    (off, _, _), (got, events, pools) = runs[False], runs[True]
    assert got == off, f"{policy}: texts differ with the prefix cache on and a small pool"
    kinds = {e.kind for e in events}
    assert "preempt" in kinds, (
        "nine prompts in 14 pages must run short of pages and preempt: none was preempted, so "
        "pages were handed out that should not have been (can_allocate counting held pages as "
        "free, or allocate taking a page some table still holds)"
    )
    assert sum(cached(events)) > 0, "no prompt found a cached page"
    assert sum(p.evictions for p in pools) > 0, (
        "no cached page was ever evicted in 14 pages: when the free list is empty, allocate must "
        "take the least recently used cached page (and count it in evictions)"
    )
    assert_all_pages_free(pools, f"{policy}: every request has ended")
    assert all(not p.refs for p in pools), "references are left after every request ended"


def check_counts(engine):
    """A page's count equals the page tables holding it; a cached page is held by none; every
    page is exactly one of: held, cached, free."""
    pools = engine.pools
    if not pools or not hasattr(pools[0], "refs"):
        return
    for layer, pool in enumerate(pools):
        tables = {}
        for stream in engine.streams.values():
            for page in stream.request.kv_cache[layer].page_table:
                tables[page] = tables.get(page, 0) + 1
        assert dict(pool.refs) == tables, (
            f"layer {layer}: reference counts {dict(pool.refs)} but the page tables hold "
            f"{tables}: every page a table takes (allocate, hold) is one reference, every "
            "page it lets go (free) one less"
        )
        cached_pages, free = set(pool.lru), set(pool.free_pages)
        assert not cached_pages & set(tables), (
            f"layer {layer}: pages {sorted(cached_pages & set(tables))} are on the LRU while "
            "a page table holds them: they could be evicted in use"
        )
        assert not cached_pages & free and not free & set(tables)
        assert len(cached_pages) + len(free) + len(tables) == pool.num_pages


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_a_fault_leaves_no_reference_behind(impl, model, tokenizer, policy):
    rng = random.Random(4)
    system = chat(rng, 12)
    prompts = [system + chat(rng, 3) for _ in range(4)]
    engine, pools, events = engine_for(impl, model, tokenizer, True, policy, batch_size=2)
    serve_greedy(engine, prompts[:1], 3)  # the system prompt is cached now

    class Boom(Exception):
        pass

    seen = []

    def explode(step):
        seen.append(step.kind)
        if seen.count("prefill") == 3:
            raise Boom

    engine.on_step = explode
    with pytest.raises(Boom):
        serve_greedy(engine, prompts[1:], 4)
    assert_all_pages_free(pools, f"{policy}: after a fault")
    assert all(not p.refs for p in pools), "after a fault every reference must be dropped"
    assert pools[0].num_cached > 0, "the cached pages keep their contents after a fault"


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_a_collision_serves_no_wrong_kv(impl, model, tokenizer, policy, monkeypatch):
    monkeypatch.setattr(module(impl), "page_key", lambda parent, tokens: 7)
    rng = random.Random(5)
    first = chat(rng, 12)
    prompts = [first, chat(rng, 12), first[:4] + chat(rng, 8), first]
    runs = {}
    for on in (False, True):
        engine, _, events = engine_for(impl, model, tokenizer, on, policy, batch_size=1)
        runs[on] = serve_greedy(engine, prompts, 5), events
    assert runs[True][0] == runs[False][0], (
        f"{policy}: with every page key alike the texts changed: a lookup served a page whose "
        "tokens or parent entry differ from the prompt's"
    )
    assert cached(runs[True][1]) == [0, 0, 4, 4], (
        "with one key for every page only a prompt's first page can be indexed; prompts that "
        "start with it find 4 tokens"
    )


def test_dense_caches_and_plain_pools_are_unchanged(impl, model, tokenizer):
    prompt = chat(random.Random(6), 10)
    engine = impl.Engine(model, tokenizer, max_seq_len=MAX_SEQ_LEN, batch_size=2)
    serve_greedy(engine, [prompt, prompt], 3)
    assert engine.stats()["prompt_tokens_cached"] == 0, "dense caches have no prefix cache"
    plain = model.create_kv_pools(page_size=PAGE)
    assert not isinstance(plain[0], impl.TinyKvSharedPool), "prefix_cache=False: plain pools"


# --- Task 4: admission with shared pages ------------------------------------------------------


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_admission_counts_only_the_pages_a_prompt_takes_anew(impl, model, tokenizer, policy):
    rng = random.Random(7)
    first = chat(rng, 17)  # 5 pages of 4
    second = first[:16] + chat(rng, 3)  # 4 pages shared with `first`, 1 of its own
    engine, pools, events = engine_for(
        impl, model, tokenizer, True, policy, max_pages=9, batch_size=2
    )
    got = serve_greedy(engine, [first, second], [8, 4], check=check_counts)
    order = [(e.kind, e.request.prompt_idx) for e in events if e.kind in ("admit", "finish")]
    assert order.index(("admit", 1)) < order.index(("finish", 0)), (
        f"events {order}: the second prompt shares 4 pages the first one holds, so it needs 1 "
        "new page and 1 of headroom and fits beside it; admission must count only the pages "
        "it takes anew (tokens_to_admit), not its whole prompt"
    )
    assert cached(events)[1] == 16
    off, _, _ = engine_for(impl, model, tokenizer, False, policy, max_pages=9, batch_size=2)
    assert got == serve_greedy(off, [first, second], [8, 4])


def test_a_prompt_cached_to_its_end_still_takes_its_last_page_anew(impl, model, tokenizer):
    """A prompt of whole pages, all of them held by a running request: its last token is
    computed again (its logits give the first token), so admission counts its last page as
    new, found pages end one token before the prompt does (cached_prefix's limit)."""
    pools = model.create_kv_pools(page_size=PAGE, prefix_cache=True)
    prompt = chat(random.Random(9), 4 * PAGE)
    first = impl.Request(model, tokenizer, prompt, pools=pools)
    while not first.is_prefill_done:
        first.try_prefill()
    second = impl.Request(model, tokenizer, prompt, pools=pools)
    try:
        assert impl.tokens_to_admit(second) == PAGE, (
            f"tokens_to_admit of a {4 * PAGE}-token prompt whose {4} pages a running request "
            f"holds: {impl.tokens_to_admit(second)}, want {PAGE}: look for cached pages among the "
            "first len(tokens) - 1 tokens only; the last page is prefilled anew"
        )
    finally:
        first.release()
        second.release()


def test_cached_pages_no_request_holds_count_at_admission(impl, model, tokenizer):
    """A prompt whose pages are cached but held by no running request (they wait on the LRU):
    admission counts them all, since taking them off the LRU uses up pages an allocation could
    have reclaimed."""
    pools = model.create_kv_pools(page_size=PAGE, prefix_cache=True)
    prompt = chat(random.Random(10), 4 * PAGE + 2)
    first = impl.Request(model, tokenizer, prompt, pools=pools)
    while not first.is_prefill_done:
        first.try_prefill()
    first.release()
    assert pools[0].num_cached == 4, "the first request's 4 full pages wait on the LRU (setup)"
    second = impl.Request(model, tokenizer, prompt, pools=pools)
    try:
        got = impl.tokens_to_admit(second)
        assert got == len(prompt), (
            f"tokens_to_admit of a {len(prompt)}-token prompt whose 4 full pages are cached "
            f"but held by no request: {got}, want {len(prompt)}: subtract only the pages a "
            "running request holds (pool.refs), not the cached ones on the LRU"
        )
    finally:
        second.release()


def test_engine_reports_cached_tokens(impl, model, tokenizer):
    rng = random.Random(8)
    system = chat(rng, 9)
    engine, _, _ = engine_for(impl, model, tokenizer, True, "alternate", batch_size=1)
    params = impl.SamplingParams(max_tokens=2)
    first = engine.add_request(system + [5], params)
    second = engine.add_request(system + [6, 7], params)
    last = {}
    while engine.has_work:
        for out in engine.step():
            last[out.request_id] = out
    assert last[first].cached_tokens == 0 and last[second].cached_tokens == 8, (
        "RequestOutput.cached_tokens: the prompt tokens the request's admission found cached"
    )
    stats = engine.stats()
    assert stats["prompt_tokens_cached"] == 8 and stats["pages_cached"] > 0

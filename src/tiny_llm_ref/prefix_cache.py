"""Week 4 Day 4: prefix caching. Pages shared by content, so a prompt that starts like an
earlier one skips that part of its prefill.

A page's keys and values depend on its own tokens and on every token before it: attention in
the layers below mixed the earlier positions in, and RoPE turned each key by its absolute
position. So a full page is named by a chained key, page_key(the entry before it, its token
ids), and two pages share only when the whole prefix up to their end is the same.

A sharing pool keeps, beside its pages:

- refs: how many page tables hold each page handed out;
- an index from key to the cached page holding that content; every hit is confirmed against
  the stored token ids and the entry before it, so a hash collision is a miss, never another
  prompt's KV;
- an LRU of cached pages that no page table holds: they keep their contents and can be found
  again, until an allocation finds no free page and takes the least recently used one.

A request admitted with a prompt whose first full pages are cached puts those pages into its
page tables and prefills from the first token after them (the chunk at an offset of 3.2). Its
own pages are registered as they fill, prompt and generated tokens alike, so the next turn of
a chat finds the answer too. Only full pages are shared; the last, partial page is always the
request's own, so nothing a request writes can land in a page another one reads.

Every layer has its own pool. Every pool sees the same requests in the same order, so all of
them make the same matches; the first layer's pool stands for all of them in the planning.
"""

from collections import OrderedDict
from dataclasses import dataclass

from .paged_kv_cache import PagePoolExhausted, TinyKvPagedPool
from .quantized_kv_cache import TinyKvQuantizedPagedPool

ROOT = -1  # the entry "before" a prompt's first page


def page_key(parent: int, tokens: tuple[int, ...]) -> int:
    """The index key of a full page: a hash of the entry before it and its own token ids."""
    # BEGIN TASK Week 4 Day 4, Task 1: a chained key for a full page
    return hash((parent, tokens))
    # END TASK


@dataclass
class CachedPage:
    """A full page the index can find. `entry` names its content and is never reused, even
    after the page is evicted; `parent` is the entry of the page before it (ROOT for a
    prompt's first page)."""

    page: int
    entry: int
    parent: int
    tokens: tuple[int, ...]


class TinyKvSharedPool(TinyKvPagedPool):
    """A page pool whose full pages are shared by content (Week 4 Day 4).

    free(page) drops one page table's reference; a page no table holds goes back to the free
    list, or, if the index can find it, to the LRU of cached pages. allocate() takes a free
    page (or creates one) first and evicts the least recently used cached page only when
    there is none. num_in_use counts the pages some table holds, so the cached pages count as
    free in the planning of Week 3 Day 6: any allocation can reclaim them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refs: dict[int, int] = {}  # page -> page tables holding it (pages in use only)
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unheld: oldest first
        self.index: dict[int, CachedPage] = {}  # key -> the cached page with that content
        self.key_of: dict[int, int] = {}  # page -> its key in the index
        self.entries = 0  # entry ids handed out so far
        self.evictions = 0

    @property
    def num_in_use(self) -> int:
        return self.num_pages - len(self.free_pages) - len(self.lru)

    @property
    def num_cached(self) -> int:
        """Pages that keep their contents for a later prompt while no page table holds them."""
        return len(self.lru)

    def can_allocate(self, n: int) -> bool:
        return super().can_allocate(n - len(self.lru))  # cached pages can be evicted

    def allocate(self) -> int:
        """A page for one page table: a free page if there is one, else the least recently
        used cached page, which leaves the index."""
        # BEGIN TASK Week 4 Day 4, Task 2: allocate from the free pages, then evict from the LRU
        if super().can_allocate(1):
            page = super().allocate()
        elif self.lru:
            page, _ = self.lru.popitem(last=False)  # the least recently used
            del self.index[self.key_of.pop(page)]
            self.evictions += 1
            self.num_allocations += 1
        else:
            raise PagePoolExhausted(f"all {self.max_pages} pages are in use")
        self.refs[page] = 1
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)
        return page
        # END TASK

    def hold(self, page: int) -> None:
        """One more page table holds the cached page `page` (it leaves the LRU if it was on it)."""
        # BEGIN TASK Week 4 Day 4, Task 2: take a reference to a cached page
        self.lru.pop(page, None)
        self.refs[page] = self.refs.get(page, 0) + 1
        self.peak_in_use = max(self.peak_in_use, self.num_in_use)
        # END TASK

    def free(self, page: int) -> None:
        """One page table lets go of `page`."""
        # BEGIN TASK Week 4 Day 4, Task 2: drop a reference; an unheld page is cached or freed
        if page not in self.refs:
            raise ValueError(f"page {page} is not held by any page table")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            del self.refs[page]
            if page in self.key_of:
                self.lru[page] = None  # keeps its contents; the most recently used now
            else:
                super().free(page)
        # END TASK

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> CachedPage | None:
        """The cached page holding `tokens` right after the entry `parent`, or None."""
        # BEGIN TASK Week 4 Day 4, Task 1: find a page by its key, confirmed by its content
        found = self.index.get(page_key(parent, tokens))
        if found is None or found.parent != parent or found.tokens != tokens:
            return None  # not cached, or a collision: another content has this key
        return found
        # END TASK

    def register(self, page: int, parent: int, tokens: tuple[int, ...]) -> int:
        """`page` is full, holding `tokens` after the entry `parent`: make it findable.
        Returns the entry of this content: the page's new one; the existing one if another
        page already holds the same content (computed twice, this page stays private); or a
        fresh entry no lookup reaches if other content has the key (a collision)."""
        # BEGIN TASK Week 4 Day 4, Task 1: index a full page under its key
        key = page_key(parent, tokens)
        found = self.index.get(key)
        if found is not None and found.parent == parent and found.tokens == tokens:
            return found.entry
        self.entries += 1
        if found is None:
            self.index[key] = CachedPage(page, self.entries, parent, tokens)
            self.key_of[page] = key
        return self.entries
        # END TASK


class TinyKvSharedQuantizedPool(TinyKvSharedPool, TinyKvQuantizedPagedPool):
    """INT8 pages (Week 4 Day 1), shared by content."""


def shares_prefix(request) -> bool:
    """Whether the request's pages live in sharing pools."""
    return request.pools is not None and isinstance(request.pools[0], TinyKvSharedPool)


def cached_prefix(pool: TinyKvSharedPool, tokens: list[int], limit: int) -> list[CachedPage]:
    """The cached pages holding the first full pages of `tokens`, in order, up to the first
    page that is not cached, covering at most `limit` tokens."""
    # BEGIN TASK Week 4 Day 4, Task 3: follow the chain of full pages through the index
    size, found, parent = pool.page_size, [], ROOT
    while (len(found) + 1) * size <= limit:
        start = len(found) * size
        page = pool.lookup(parent, tuple(tokens[start : start + size]))
        if page is None:
            break
        found.append(page)
        parent = page.entry
    return found
    # END TASK


def tokens_to_admit(request) -> int:
    """The tokens of the request's prefill that need pages no page table holds yet: its
    pages shared with a running request cost nothing, a cached page no table holds counts
    (taking it off the LRU uses up a reclaimable page)."""
    tokens = len(request.prefill_tokens)
    if not shares_prefix(request):
        return tokens
    # BEGIN TASK Week 4 Day 4, Task 4: admission counts only the pages a prompt takes anew
    pool = request.pools[0]
    found = cached_prefix(pool, request.prefill_tokens, tokens - 1)
    held = sum(1 for cached in found if cached.page in pool.refs)
    return tokens - held * pool.page_size
    # END TASK


def reuse_prefix(request) -> int:
    """On admission: every layer's page table starts with the cached pages that hold the
    prefill's first full pages, and prefill goes on after them. The last prefill token is
    always computed (its logits give the next token). Returns the tokens found."""
    # BEGIN TASK Week 4 Day 4, Task 3: start the page tables with the cached pages
    tokens = request.prefill_tokens
    for cache, entries in zip(request.kv_cache, request.entries):
        found = cached_prefix(cache.pool, tokens, len(tokens) - 1)
        for cached in found:
            cache.pool.hold(cached.page)
        cache.share([cached.page for cached in found])
        entries[:] = [cached.entry for cached in found]
    offsets = {cache.offset for cache in request.kv_cache}
    if len(offsets) != 1:
        raise RuntimeError(f"the layers' pools found different cached prefixes: {offsets}")
    request.offset = offsets.pop()
    return request.offset
    # END TASK


def register_full_pages(request) -> None:
    """Make the request's pages that filled up since the last call findable: every page
    whose tokens are all in the cache (prompt and generated tokens alike)."""
    # BEGIN TASK Week 4 Day 4, Task 1: register each page as it fills
    tokens = request.prefill_tokens  # the cache holds tokens[: request.offset]
    for cache, entries in zip(request.kv_cache, request.entries):
        size = cache.pool.page_size
        for i in range(len(entries), request.offset // size):
            parent = entries[-1] if entries else ROOT
            page_tokens = tuple(tokens[i * size : (i + 1) * size])
            entries.append(cache.pool.register(cache.page_table[i], parent, page_tokens))
    # END TASK

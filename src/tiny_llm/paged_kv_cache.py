"""Week 2 Day 2: a paged KV cache. Week 3 Day 2 adds the materialize() hook, Week 3 Day 3
rewind(), Week 3 Day 5 attention that reads the pages where they lie, Week 4 Day 8 copy on
write for page tables forked from one prompt.

A pool owns fixed-size pages of key/value storage for one layer; a request's cache owns only
a page table (which pages hold its tokens, in order). Releasing a request returns its pages.
"""

import mlx.core as mx

from .flash_attention import paged_attention
from .kv_cache import TinyKvCache, check_rewind


class PagePoolExhausted(RuntimeError):
    """The pool reached its page limit; nothing was allocated or written."""


def grown(pages: mx.array, capacity: int) -> mx.array:
    """pages [n, ...] copied into the first n rows of zeros [capacity, ...]."""
    out = mx.zeros((capacity, *pages.shape[1:]), dtype=pages.dtype)
    out[: pages.shape[0]] = pages
    return out


def in_page_order(array: mx.array, pages: list[int], length: int) -> mx.array:
    """One storage array [capacity, H_kv, P, X] -> the first `length` token slots of `pages`,
    side by side in page-table order: [H_kv, length, X]. Every pool reads its pages with it."""
    raise NotImplementedError("Week 2 Day 2, Task 2: read pages back in page-table order")


class TinyKvPagedPool:
    """Pages of one layer, in one array each for keys and values.

    key_pages / value_pages are [capacity, H_kv, page_size, D]: page i is key_pages[i]. Pages
    0 .. num_pages - 1 have been handed out at least once; the capacity beyond them is room to
    grow into, added in blocks (see _grow) rather than one page at a time.

    read_in_place (Week 3 Day 5): the model attends over this pool's pages where they lie,
    through paged_attention, instead of gathering each request's pages into a dense copy.
    """

    grow_tokens = 256  # the capacity grows by at least this many token slots at a time
    attention_block = 128  # token slots paged attention reads per step of its walk (Week 3 Day 5)
    decode_kernel = None  # use_own_decode_kernel: one-query rows go through it (Week 5 Day 2)

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = 16,
        max_pages: int | None = None,
        dtype: mx.Dtype = mx.float32,
        read_in_place: bool = False,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_pages is not None and max_pages < 1:
            raise ValueError(f"max_pages must be >= 1 or None, got {max_pages}")
        self.num_kv_heads, self.head_dim, self.page_size = num_kv_heads, head_dim, page_size
        self.max_pages, self.dtype = max_pages, dtype
        self.read_in_place = read_in_place
        empty = (0, num_kv_heads, page_size, head_dim)
        self.key_pages = mx.zeros(empty, dtype=dtype)  # [capacity, H_kv, P, D]
        self.value_pages = mx.zeros(empty, dtype=dtype)
        self.num_pages = 0  # physical pages created so far (in use or free)
        self.free_pages: list[int] = []
        self.num_allocations = 0  # pages handed out over the pool's life (reuse counts again)
        self.peak_in_use = 0

    @property
    def capacity(self) -> int:
        """Pages the storage arrays have room for."""
        return self.key_pages.shape[0]

    @property
    def storage(self) -> list[mx.array]:
        """Every array the pool stores pages in."""
        return [self.key_pages, self.value_pages]

    @property
    def nbytes(self) -> int:
        """Bytes held by the storage arrays (their capacity, not only the pages in use)."""
        return sum(array.nbytes for array in self.storage)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)

    def can_allocate(self, n: int) -> bool:
        raise NotImplementedError(
            "Week 2 Day 2, Task 1: count the pages the pool can still hand out"
        )

    def allocate(self) -> int:
        """Hand out a free page, reusing a released one before creating a new one."""
        raise NotImplementedError("Week 2 Day 2, Task 1: allocate a page (reuse freed pages first)")

    def _grow(self) -> None:
        """New storage arrays with room for more pages: twice the capacity, and at least
        grow_tokens more slots, but never more than max_pages. The pages made so far are copied
        over once; growing by doubling keeps that copying linear in the final size."""
        more = -(-self.grow_tokens // self.page_size)
        capacity = max(2 * self.capacity, self.capacity + more)
        if self.max_pages is not None:
            capacity = min(capacity, self.max_pages)
        self._resize(capacity)

    def _resize(self, capacity: int) -> None:
        """Replace every storage array with one of `capacity` pages (Week 4 Day 1's quantized
        pool has more arrays than these two)."""
        self.key_pages = grown(self.key_pages, capacity)
        self.value_pages = grown(self.value_pages, capacity)

    def copy_page(self, source: int, target: int) -> None:
        """Page `target` gets page `source`'s contents, every storage array of it (Week 4 Day 8)."""
        for array in self.storage:  # a slice update changes the pool's own array
            array[target] = array[source]

    def free(self, page: int) -> None:
        raise NotImplementedError("Week 2 Day 2, Task 1: return a page to the free list")

    def write(self, page: int, start: int, key: mx.array, value: mx.array) -> None:
        """Store key/value [H_kv, n, D] at slots start .. start + n of one page."""
        raise NotImplementedError("Week 2 Day 2, Task 2: write keys/values into a page")

    def gather(self, pages: list[int], length: int) -> tuple[mx.array, mx.array]:
        """The first `length` tokens stored in `pages`, as dense [H_kv, length, D] arrays (a
        copy: the Week 2 way to read pages, which Week 3 Day 5 replaces with paged_attention)."""
        keys = in_page_order(self.key_pages, pages, length)  # [H_kv, length, D]
        return keys, in_page_order(self.value_pages, pages, length)


class TinyKvPagedCache(TinyKvCache):
    """One request's view of a pool: a page table and a token count."""

    def __init__(self, pool: TinyKvPagedPool):
        self.pool = pool
        self.page_table: list[int] = []
        self._offset = 0

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def reads_in_place(self) -> bool:
        """Whether the model calls attend() (pages read in place) rather than update_and_fetch
        (pages gathered into a dense copy): the pool's choice."""
        return self.pool.read_in_place

    @property
    def pages_in_place(self) -> bool:
        """Whether 3.4's ragged pass may write this cache's new keys/values with every other
        segment's in one scatter (reserve) and attend over its pages in place (Week 3 Day 5,
        Task 5): float pages read in place, full attention (a windowed cache gives pages back)."""
        return self.pool.read_in_place and self.window is None

    def _check(self, key: mx.array, value: mx.array) -> None:
        pool = self.pool
        expected = (1, pool.num_kv_heads, key.shape[2], pool.head_dim)
        if key.shape != expected or value.shape != expected:
            raise ValueError(
                f"paged cache takes key/value of shape [1, {pool.num_kv_heads}, L, "
                f"{pool.head_dim}], got {key.shape} and {value.shape}"
            )
        if key.dtype != pool.dtype or value.dtype != pool.dtype:
            raise ValueError(f"pool stores {pool.dtype}, got {key.dtype} and {value.dtype}")

    def append(self, key: mx.array, value: mx.array) -> None:
        """Write key/value [1, H_kv, L, D] into the request's pages, allocating what it needs."""
        if self.shares_last_page:  # a fork's page (Week 4 Day 8): copied before it is written
            self.copy_on_write()
        raise NotImplementedError("Week 2 Day 2, Task 3: append through the page table")

    def reserve(self, length: int) -> list[int]:
        """Take the pages `length` more tokens need and count those tokens as cached; return
        the slot of each in the pool, page * page_size + position in the page. The caller
        writes their keys/values there (Week 3 Day 5 writes a whole ragged pass in one scatter)."""
        if self.shares_last_page:  # a fork's page (Week 4 Day 8): copied before it is written
            self.copy_on_write()
        raise NotImplementedError(
            "Week 3 Day 5, Task 5: reserve the slots of a segment's new tokens"
        )

    def share(self, pages: list[int], length: int | None = None) -> None:
        """Start the empty page table with pages another table filled: full pages (Week 4 Day
        4), or `length` tokens whose last page may be partly filled (a fork, Week 4 Day 8).
        Their tokens count as cached. The caller has taken a reference to each page."""
        if self.page_table:
            raise ValueError("only an empty page table can start with shared pages")
        self.page_table = list(pages)
        self._offset = len(pages) * self.pool.page_size if length is None else length

    @property
    def shares_last_page(self) -> bool:
        """Whether the next token would land in a partly filled page that another page table
        holds too (only a fork shares a page that is not full, Week 4 Day 8)."""
        refs = getattr(self.pool, "refs", None)  # reference counts: a sharing pool (Week 4 Day 4)
        partial = self._offset % self.pool.page_size != 0
        return bool(refs) and partial and refs.get(self.page_table[-1], 0) > 1

    def copy_on_write(self) -> None:
        """The last page is shared: give this table a copy of its own, and let go of the
        shared one (the other tables keep it)."""
        raise NotImplementedError(
            "Week 4 Day 8, Task 5: copy the shared last page before writing into it"
        )

    def update_and_fetch(self, key: mx.array, value: mx.array) -> tuple[mx.array, mx.array, None]:
        """Append, then gather every cached token into dense [1, H_kv, S, D] arrays."""
        self.append(key, value)
        keys, values = self.pool.gather(self.page_table, self._offset)  # [H_kv, S, D]
        return keys[None], values[None], None  # [1, H_kv, S, D]

    def attend(self, query: mx.array, key: mx.array, value: mx.array) -> mx.array:
        """Append key/value [1, H_kv, L, D], then attend query [1, H_q, L, D] causally over every
        cached token, reading the pages where they lie -> [1, H_q, L, D]."""
        raise NotImplementedError(
            "Week 3 Day 5, Task 3: append, then attend over the pages in place"
        )

    def materialize(self) -> None:
        raise NotImplementedError(
            "Week 3 Day 2, Task 3: evaluate the pool pages without gathering them"
        )

    def rewind(self, length: int) -> None:
        """Keep the first `length` tokens; pages that only held later tokens go back to the pool."""
        raise NotImplementedError(
            "Week 3 Day 3, Task 3: roll the paged cache back, returning pages past the end"
        )

    def release(self) -> None:
        raise NotImplementedError("Week 2 Day 2, Task 4: release every page of the request")

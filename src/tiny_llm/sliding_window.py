"""Week 4 Day 7: sliding-window attention, and caches that let go of what left the window.

In a layer with a window of W positions, the query at position p sees the keys at positions
p - W + 1 ..= p: the causal mask of Week 3 Day 2 with a lower edge as well. A chunk of L queries
that ends at the last of its keys therefore needs only the last L + W - 1 keys, however long the
sequence, and a decode step (L = 1) only the last W.

That bounds what a windowed layer must keep. The dense windowed cache here still keeps every
key (a simple array that grows; only what attention reads is bounded), while the paged one
returns each page whose positions have all left the window to the pool, so a request's memory
in that layer stops growing at about W tokens (plus one chunk and a page).
"""

import math

import mlx.core as mx

from .flash_attention import block_partial, finish, merge_partials
from .kv_cache import TinyKvFullCache, check_rewind
from .paged_kv_cache import TinyKvPagedCache, TinyKvPagedPool


def window_mask(L: int, S: int, window: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """[L, S] additive mask for L queries at the end of S keys, each seeing its own position
    and the window - 1 before it: query i sits at position S - L + i."""
    raise NotImplementedError("Week 4 Day 7, Task 1: the banded mask of a sliding window")


def windowed_attention(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    window: int,
    scale: float | None = None,
    block_size: int = 128,
) -> mx.array:
    """Sliding-window attention in blocks, with the online softmax of Week 3 Day 5.

    query [B, H_q, L, D], key/value [B, H_kv, S, D]: query row i at position S - L + i sees the
    keys S - L + i - window + 1 ..= S - L + i. For each block of queries only the key blocks
    that overlap its band are read: those wholly before the band, like those wholly after the
    diagonal, are skipped. -> [B, H_q, L, D].
    """
    l, s = query.shape[2], key.shape[2]
    if not 1 <= l <= s or window < 1:
        raise ValueError(f"windowed attention needs 1 <= L <= S and window >= 1, got L={l}, S={s}")
    raise NotImplementedError(
        "Week 4 Day 7, Task 2: flash attention over the band of a sliding window"
    )


def in_window(keys: mx.array, values: mx.array, length: int, window: int):
    """The last length + window - 1 positions of keys/values [B, H_kv, S, D] (all of them when
    there are fewer): every key that length queries at the end may see, and a mask for them."""
    keep = min(keys.shape[2], length + window - 1)
    mask = window_mask(length, keep, window, keys.dtype) if length > 1 else None
    return keys[:, :, -keep:, :], values[:, :, -keep:, :], mask


class AttendsTheWindow:
    """What both windowed caches share: the model calls attend() (reads_in_place), which
    attends with windowed_attention over what the cache's update_and_fetch returns: the keys
    and values of the window only."""

    reads_in_place = True
    window: int

    def attend(self, query: mx.array, key: mx.array, value: mx.array) -> mx.array:
        keys, values, _ = self.update_and_fetch(key, value)
        return windowed_attention(query, keys, values, self.window)


class TinyKvWindowedCache(AttendsTheWindow, TinyKvFullCache):
    """A dense cache for a layer with a sliding window: it keeps every key (the arrays grow as
    for full attention), but attention reads only the last L + window - 1 of them."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def update_and_fetch(self, key: mx.array, value: mx.array):
        """Append, then return the keys/values the new queries may see, with their band mask
        (None for one query: it sees every key returned)."""
        keys, values, _ = super().update_and_fetch(key, value)
        return in_window(keys, values, key.shape[2], self.window)


class TinyKvWindowedPagedCache(AttendsTheWindow, TinyKvPagedCache):
    """A paged cache for a layer with a sliding window: before each append it gives back to the
    pool every page whose positions have all left the window of the next query.

    The page table keeps its positions: its first `released` entries name pages already given
    back (they may belong to another request by now) and are never read or freed again.
    """

    def __init__(self, pool: TinyKvPagedPool, window: int):
        super().__init__(pool)
        self.window = window
        self.released = 0  # leading page-table entries given back to the pool

    def release_left_behind(self) -> None:
        """Give back the pages no query from position `offset` on can see: those whose last
        position is before offset - window + 1."""
        raise NotImplementedError("Week 4 Day 7, Task 3: give back the pages that left the window")

    def update_and_fetch(self, key: mx.array, value: mx.array):
        """Let go of what left the window, append, then gather the pages still held (from the
        first one not released) and return what the new queries may see, with its mask."""
        self.release_left_behind()
        self.append(key, value)
        start = self.released * self.pool.page_size  # the position of the first page held
        keys, values = self.pool.gather(self.page_table[self.released :], self.offset - start)
        return in_window(keys[None], values[None], key.shape[2], self.window)

    def share(self, pages: list[int]) -> None:
        raise ValueError("a windowed layer gives its pages back: its pages cannot be shared")

    def rewind(self, length: int) -> None:
        """Roll back to `length` tokens; the window of the query at `length` must still be
        held (a rewind of a few guessed tokens always is)."""
        check_rewind(length, self.offset)
        first_seen = max(0, length - self.window + 1)  # the first key the query at length sees
        if first_seen < self.released * self.pool.page_size:
            raise ValueError(
                f"cannot rewind to {length} tokens: the pages before position "
                f"{self.released * self.pool.page_size} have left the window and gone back"
            )
        super().rewind(length)

    def release(self) -> None:
        """Free the pages still held; the released entries were freed already."""
        self.page_table = self.page_table[self.released :]
        self.released = 0
        super().release()

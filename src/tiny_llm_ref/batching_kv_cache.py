"""Week 3 Day 1: one cache per layer that decodes several requests together.

Each slot holds one request's own cache for this layer (dense or paged). A batched step
appends one token per active request to that request's cache, then copies the rows into one
padded batch and masks the padding, so no row attends to another row's positions.
Week 3 Day 5: when every active request is paged on one pool, a step reads their pages in
place instead, through one padded page table.
"""

import mlx.core as mx

from .flash_attention import paged_attention
from .kv_cache import TinyKvCache, check_rewind
from .paged_kv_cache import PagePoolExhausted, TinyKvPagedCache


class BatchingKvCache(TinyKvCache):
    step = 256  # the padded batch grows in blocks of this many positions

    def __init__(self, max_active_requests: int):
        if max_active_requests < 1:
            raise ValueError(f"max_active_requests must be >= 1, got {max_active_requests}")
        self.slots: list[TinyKvCache | None] = [None] * max_active_requests
        # the padded batch [max_active_requests, H_kv, capacity, D], reused from step to step
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def active_slots(self) -> list[int]:
        return [i for i, c in enumerate(self.slots) if c is not None]

    @property
    def offset(self) -> list[int]:
        """The token count of each active request, in slot order (one per batch row)."""
        return [self.slots[i].offset for i in self.active_slots]

    @property
    def reads_in_place(self) -> bool:
        """True when every active request is a paged cache that reads in place, all on one
        pool, for a layer without a sliding window (Week 4 Day 7: those read only their
        window, through their own update_and_fetch)."""
        caches = [self.slots[i] for i in self.active_slots]
        paged = all(
            isinstance(c, TinyKvPagedCache) and c.reads_in_place and c.window is None
            for c in caches
        )
        return bool(caches) and paged and len({id(c.pool) for c in caches}) == 1

    def add_request(self, prefilled: TinyKvCache, slot: int) -> None:
        # BEGIN TASK Week 3 Day 1, Task 1: put a prefilled request cache into a slot
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"slot {slot} is outside 0..{len(self.slots) - 1}")
        if self.slots[slot] is not None:
            raise ValueError(f"slot {slot} is already taken")
        self.slots[slot] = prefilled
        # END TASK

    def remove_request(self, slot: int) -> TinyKvCache:
        # BEGIN TASK Week 3 Day 1, Task 1: take a request cache out of its slot
        if not 0 <= slot < len(self.slots) or self.slots[slot] is None:
            raise ValueError(f"slot {slot} holds no request")
        cache, self.slots[slot] = self.slots[slot], None
        return cache
        # END TASK

    def update_and_fetch(
        self, key: mx.array, value: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        # key/value [B, H_kv, 1, D], row b belongs to the b-th active slot
        # BEGIN TASK Week 3 Day 1, Task 2: batched append with per-row masks
        active = self.active_slots
        if key.shape[0] != len(active) or key.shape[2] != 1:
            raise ValueError(
                f"batched decode takes one token for each of the {len(active)} active "
                f"requests, got key of shape {key.shape}"
            )
        rows = [
            self.slots[slot].update_and_fetch(key[b : b + 1], value[b : b + 1])[:2]
            for b, slot in enumerate(active)
        ]  # each ([1, H_kv, S_b, D], [1, H_kv, S_b, D])
        lengths = [k.shape[2] for k, _ in rows]
        s = max(lengths)
        self._reserve(s, key)
        for b, (k, v) in enumerate(rows):
            self.keys[b : b + 1, :, : k.shape[2], :] = k
            self.values[b : b + 1, :, : v.shape[2], :] = v
        visible = mx.arange(s)[None, :] < mx.array(lengths)[:, None]  # [B, S]
        mask = mx.where(visible, 0.0, -mx.inf).astype(key.dtype)
        n = len(rows)
        keys, values = self.keys[:n, :, :s, :], self.values[:n, :, :s, :]  # [B, H_kv, S, D]
        return keys, values, mask[:, None, None, :]  # mask [B, 1, 1, S]
        # END TASK

    def attend(self, query: mx.array, key: mx.array, value: mx.array) -> mx.array:
        """One decode token per active request: query [B, H_q, 1, D], key/value [B, H_kv, 1, D],
        row b for the b-th active slot -> [B, H_q, 1, D], every row over its own pages."""
        active = self.active_slots
        if key.shape[0] != len(active) or key.shape[2] != 1 or query.shape[0] != len(active):
            raise ValueError(
                f"batched decode takes one token for each of the {len(active)} active "
                f"requests, got query {query.shape} and key {key.shape}"
            )
        caches = [self.slots[i] for i in active]
        pool = caches[0].pool
        new_pages = sum(c.offset % pool.page_size == 0 for c in caches)  # rows at a page's end
        if not pool.can_allocate(new_pages):
            raise PagePoolExhausted(f"this step needs {new_pages} new pages; the pool is full")
        # BEGIN TASK Week 3 Day 5, Task 4: batched decode over every request's pages in place
        for b, cache in enumerate(caches):
            cache.append(key[b : b + 1], value[b : b + 1])
        tables = [cache.page_table for cache in caches]
        lengths = [cache.offset for cache in caches]
        return paged_attention(query, pool, tables, lengths, block_size=pool.attention_block)
        # END TASK

    def _reserve(self, length: int, like: mx.array) -> None:
        """Make the padded batch hold `length` positions.

        The buffer is reused from step to step: a fresh [B, H_kv, S, D] array per layer per
        step (what mx.pad + mx.concatenate would make) costs a new allocation each time, which
        made a decode step several times slower on the CPU.
        """
        _, h, _, d = like.shape
        kept = self.keys is not None and self.keys.shape[2] >= length
        if kept and (self.keys.shape[1], self.keys.shape[3], self.keys.dtype) == (h, d, like.dtype):
            return
        shape = (len(self.slots), h, -(-length // self.step) * self.step, d)
        self.keys, self.values = mx.zeros(shape, like.dtype), mx.zeros(shape, like.dtype)

    def materialize(self) -> None:
        # BEGIN TASK Week 3 Day 2, Task 3: materialize every active request cache
        for slot in self.active_slots:
            self.slots[slot].materialize()
        # END TASK

    def rewind(self, length: list[int]) -> None:
        """One length per active request, in slot order, as `offset` gives them."""
        # BEGIN TASK Week 3 Day 3, Task 3: roll every active request back to its length
        active = self.active_slots
        if len(length) != len(active):
            raise ValueError(f"{len(length)} lengths for {len(active)} active requests")
        for slot, n in zip(active, length):
            check_rewind(n, self.slots[slot].offset)  # every length is checked before any change
        for slot, n in zip(active, length):
            self.slots[slot].rewind(n)
        # END TASK

    def release(self) -> None:
        """Release every request cache still in a slot and empty the slots."""
        for slot in self.active_slots:
            self.remove_request(slot).release()
        self.keys, self.values = None, None

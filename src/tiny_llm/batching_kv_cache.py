"""Week 3 Day 1: one cache per layer that decodes several requests together.

Each slot holds one request's own cache for this layer (dense or paged). A batched step
appends one token per active request to that request's cache, then copies the rows into one
padded batch and masks the padding, so no row attends to another row's positions.
"""

import mlx.core as mx

from .kv_cache import TinyKvCache, check_rewind


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

    def add_request(self, prefilled: TinyKvCache, slot: int) -> None:
        raise NotImplementedError("Week 3 Day 1, Task 1: put a prefilled request cache into a slot")

    def remove_request(self, slot: int) -> TinyKvCache:
        raise NotImplementedError("Week 3 Day 1, Task 1: take a request cache out of its slot")

    def update_and_fetch(
        self, key: mx.array, value: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        # key/value [B, H_kv, 1, D], row b belongs to the b-th active slot
        raise NotImplementedError("Week 3 Day 1, Task 2: batched append with per-row masks")

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
        raise NotImplementedError("Week 3 Day 2, Task 3: materialize every active request cache")

    def rewind(self, length: list[int]) -> None:
        """One length per active request, in slot order, as `offset` gives them."""
        raise NotImplementedError(
            "Week 3 Day 3, Task 3: roll every active request back to its length"
        )

    def release(self) -> None:
        """Release every request cache still in a slot and empty the slots."""
        for slot in self.active_slots:
            self.remove_request(slot).release()
        self.keys, self.values = None, None

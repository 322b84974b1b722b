"""Week 3 Day 1: one cache per layer that decodes several requests together.

Each slot holds one request's own cache for this layer (dense or paged). A batched step
appends one token per active request to that request's cache, then pads the rows to a
common length and masks the padding, so no row attends to another row's positions.
"""

import mlx.core as mx

from .kv_cache import TinyKvCache


class BatchingKvCache(TinyKvCache):
    def __init__(self, max_active_requests: int):
        if max_active_requests < 1:
            raise ValueError(f"max_active_requests must be >= 1, got {max_active_requests}")
        self.slots: list[TinyKvCache | None] = [None] * max_active_requests

    @property
    def active_slots(self) -> list[int]:
        return [i for i, c in enumerate(self.slots) if c is not None]

    @property
    def offset(self) -> list[int]:
        """The token count of each active request, in slot order (one per batch row)."""
        return [self.slots[i].offset for i in self.active_slots]

    def add_request(self, prefilled: TinyKvCache, slot: int) -> None:
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"slot {slot} is outside 0..{len(self.slots) - 1}")
        if self.slots[slot] is not None:
            raise ValueError(f"slot {slot} is already taken")
        self.slots[slot] = prefilled

    def remove_request(self, slot: int) -> TinyKvCache:
        if not 0 <= slot < len(self.slots) or self.slots[slot] is None:
            raise ValueError(f"slot {slot} holds no request")
        cache, self.slots[slot] = self.slots[slot], None
        return cache

    def update_and_fetch(
        self, key: mx.array, value: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        # key/value [B, H_kv, 1, D], row b belongs to the b-th active slot
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
        pad = lambda x: mx.pad(x, [(0, 0), (0, 0), (0, s - x.shape[2]), (0, 0)])
        keys = mx.concatenate([pad(k) for k, _ in rows], axis=0)  # [B, H_kv, S, D]
        values = mx.concatenate([pad(v) for _, v in rows], axis=0)
        visible = mx.arange(s)[None, :] < mx.array(lengths)[:, None]  # [B, S]
        mask = mx.where(visible, 0.0, -mx.inf).astype(key.dtype)
        return keys, values, mask[:, None, None, :]  # mask [B, 1, 1, S]

    def materialize(self) -> None:
        for slot in self.active_slots:
            self.slots[slot].materialize()

    def release(self) -> None:
        """Release every request cache still in a slot and empty the slots."""
        for slot in self.active_slots:
            self.remove_request(slot).release()

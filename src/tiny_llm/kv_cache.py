"""Week 2 Day 1: the KV cache interface and the dense, append-only cache.
Week 3 Day 2 adds the materialize() hook, Week 3 Day 3 rewind(), Week 3 Day 5 attend()."""

import mlx.core as mx


class TinyKvCache:
    """What the model and the scheduler may ask of any KV cache.

    update_and_fetch appends the new keys/values and returns everything cached, plus a mask:
    None means "plain causal over my contents", an array is a mask the cache built itself
    (the batching cache does that for rows of different lengths).

    A cache whose reads_in_place is true also offers attend(): it appends and attends over its
    own storage where it lies (Week 3 Day 5), and the attention layer calls that instead.

    window: the sliding window of the layer the cache serves (Week 4 Day 7), None for full
    attention.
    """

    reads_in_place = False
    window: int | None = None
    pages_in_place = False  # Week 3 Day 4: see TinyKvPagedCache.pages_in_place

    @property
    def offset(self) -> int | list[int]:
        raise NotImplementedError

    def update_and_fetch(
        self, key: mx.array, value: mx.array
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        raise NotImplementedError

    def attend(self, query: mx.array, key: mx.array, value: mx.array) -> mx.array:
        """Append key/value [B, H_kv, L, D] and attend query [B, H_q, L, D] causally over
        everything cached, reading the storage in place -> [B, H_q, L, D]."""
        raise NotImplementedError

    def materialize(self) -> None:
        """Evaluate the cache's own storage so the lazy graph does not keep growing."""
        raise NotImplementedError

    def rewind(self, length: int | list[int]) -> None:
        """Roll the cached length back to `length`; what lies past it is overwritten later."""
        raise NotImplementedError

    def release(self) -> None:
        """Give back whatever the cache holds (pages, arrays). Safe to call twice."""
        raise NotImplementedError


class TinyKvFullCache(TinyKvCache):
    """A dense, append-only cache.

    keys/values are [B, H, capacity, D] buffers; the first `offset` positions hold the tokens.
    Capacity grows in blocks of `step` positions, so an append writes only its own rows
    instead of copying the whole cache (capacity is kept apart from length).
    """

    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._offset = 0

    @property
    def offset(self) -> int:
        return self._offset

    def update_and_fetch(self, key: mx.array, value: mx.array) -> tuple[mx.array, mx.array, None]:
        # key/value [B, H, L, D]
        raise NotImplementedError("Week 2 Day 1, Task 1: append to the dense KV cache")

    def _grow(self, needed: int, like: mx.array) -> None:
        """New buffers with room for `needed` positions, rounded up to a whole step."""
        b, h, _, d = like.shape
        shape = (b, h, -(-needed // self.step) * self.step, d)
        keys, values = mx.zeros(shape, like.dtype), mx.zeros(shape, like.dtype)
        if self.keys is not None:
            keys[:, :, : self._offset, :] = self.keys[:, :, : self._offset, :]
            values[:, :, : self._offset, :] = self.values[:, :, : self._offset, :]
        self.keys, self.values = keys, values

    def materialize(self) -> None:
        raise NotImplementedError(
            "Week 3 Day 2, Task 3: evaluate the dense cache's key/value arrays"
        )

    def rewind(self, length: int) -> None:
        raise NotImplementedError(
            "Week 3 Day 3, Task 3: roll the dense cache back to `length` tokens"
        )

    def release(self) -> None:
        self.keys, self.values = None, None
        self._offset = 0


def check_rewind(length: int, offset: int) -> None:
    if not 0 <= length <= offset:
        raise ValueError(f"cannot rewind a cache of {offset} tokens to {length}: use 0..{offset}")

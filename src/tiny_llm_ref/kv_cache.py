"""Week 2 Day 1: the KV cache interface and the dense, append-only cache.
Week 3 Day 2 adds the materialize() hook."""

import mlx.core as mx


class TinyKvCache:
    """What the model and the scheduler may ask of any KV cache.

    update_and_fetch appends the new keys/values and returns everything cached, plus a mask:
    None means "plain causal over my contents", an array is a mask the cache built itself
    (the batching cache does that for rows of different lengths).
    """

    @property
    def offset(self) -> int | list[int]:
        raise NotImplementedError

    def update_and_fetch(
        self, key: mx.array, value: mx.array
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        raise NotImplementedError

    def materialize(self) -> None:
        """Evaluate the cache's own storage so the lazy graph does not keep growing."""
        raise NotImplementedError

    def release(self) -> None:
        """Give back whatever the cache holds (pages, arrays). Safe to call twice."""
        raise NotImplementedError


class TinyKvFullCache(TinyKvCache):
    """A dense cache: keys and values [B, H, S, D], grown by appending along S."""

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._offset = 0

    @property
    def offset(self) -> int:
        return self._offset

    def update_and_fetch(
        self, key: mx.array, value: mx.array
    ) -> tuple[mx.array, mx.array, None]:
        # key/value [B, H, L, D]
        if key.shape != value.shape:
            raise ValueError(f"key {key.shape} and value {value.shape} differ in shape")
        if self.keys is None:
            self.keys, self.values = key, value
        else:
            if key.shape[:2] != self.keys.shape[:2] or key.shape[3] != self.keys.shape[3]:
                raise ValueError(f"cannot append {key.shape} to a cache of {self.keys.shape}")
            self.keys = mx.concatenate([self.keys, key], axis=2)
            self.values = mx.concatenate([self.values, value], axis=2)
        self._offset += key.shape[2]
        return self.keys, self.values, None  # [B, H, S, D] each

    def materialize(self) -> None:
        if self.keys is not None:
            mx.eval(self.keys, self.values)

    def release(self) -> None:
        self.keys, self.values = None, None
        self._offset = 0

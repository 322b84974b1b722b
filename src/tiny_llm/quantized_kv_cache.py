"""Week 4 Day 1: a dense KV cache that stores keys and values quantized (INT8 by default).

Every new key and value row [D] of every head is quantized on its own, in groups along the
head dimension, with the quantize() of the weights: what a token stores does not depend on
which tokens came in the same chunk. update_and_fetch returns everything dequantized, the new
tokens included, so attention stays the float attention of Week 1 on every path (eager,
compiled blocks, ragged batches, the batching cache); the cache saves the memory a token
holds, not the bytes attention reads.
"""

import mlx.core as mx

from tiny_llm_support import check_quant_format

from .kv_cache import TinyKvCache, TinyKvFullCache, check_rewind
from .quantize import dequantize, quantize


class TinyKvQuantizedCache(TinyKvCache):
    """Three dense caches side by side: the codes [B, H, S, D * bits / 32], scales and biases
    [B, H, S, D / group_size] of the keys (stored as their "keys") and of the values."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        check_quant_format(group_size, bits, "TinyKvQuantizedCache")
        self.group_size, self.bits = group_size, bits
        self.codes, self.scales, self.biases = (
            TinyKvFullCache(),
            TinyKvFullCache(),
            TinyKvFullCache(),
        )

    @property
    def parts(self) -> tuple[TinyKvFullCache, TinyKvFullCache, TinyKvFullCache]:
        return self.codes, self.scales, self.biases

    @property
    def offset(self) -> int:
        return self.codes.offset

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's buffers (their capacity, not only the tokens in use)."""
        return sum(p.keys.nbytes + p.values.nbytes for p in self.parts if p.keys is not None)

    def update_and_fetch(self, key: mx.array, value: mx.array) -> tuple[mx.array, mx.array, None]:
        # key/value [B, H, L, D]
        raise NotImplementedError(
            "Week 4 Day 1, Task 5: store quantized keys and values, return them dequantized"
        )

    def materialize(self) -> None:
        for part in self.parts:
            part.materialize()

    def rewind(self, length: int) -> None:
        check_rewind(length, self.offset)
        for part in self.parts:
            part.rewind(length)

    def release(self) -> None:
        for part in self.parts:
            part.release()

"""Week 4 Day 1: KV caches that store keys and values quantized (INT8 by default), dense and
paged.

Every new key and value row [D] of every head is quantized on its own, in groups along the
head dimension, with the quantize() of the weights: what a token stores does not depend on
which tokens came in the same chunk. update_and_fetch returns everything dequantized, the new
tokens included, so attention stays the float attention of Week 1 on every path (eager,
compiled blocks, ragged batches, the batching cache); the cache saves the memory a token
holds, not the bytes attention reads.

The paged pool stores the same three parts per page slot and quantizes as it writes; its
pages are read through gather() (dequantized), never in place: paged_attention walks float
pages, and a walk over quantized ones would have to dequantize each block as it goes.
"""

import mlx.core as mx

from tiny_llm_support import check_quant_format

from .kv_cache import TinyKvCache, TinyKvFullCache, check_rewind
from .paged_kv_cache import TinyKvPagedPool, grown, in_page_order
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
        # BEGIN TASK Week 4 Day 1, Task 5: store quantized keys and values, return them dequantized
        if key.shape != value.shape:
            raise ValueError(f"key {key.shape} and value {value.shape} differ in shape")
        if key.shape[-1] % self.group_size != 0:
            raise ValueError(
                f"head_dim {key.shape[-1]} is not a multiple of the cache's group_size "
                f"{self.group_size}"
            )
        k_parts = quantize(key, self.group_size, self.bits)  # codes, scales, biases
        v_parts = quantize(value, self.group_size, self.bits)
        stored = [part.update_and_fetch(k, v) for part, k, v in zip(self.parts, k_parts, v_parts)]
        (k_codes, v_codes, _), (k_scales, v_scales, _), (k_biases, v_biases, _) = stored
        keys = dequantize(k_codes, k_scales, k_biases, self.group_size, self.bits)
        values = dequantize(v_codes, v_scales, v_biases, self.group_size, self.bits)
        return keys, values, None  # [B, H, S, D]
        # END TASK

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


class TinyKvQuantizedPagedPool(TinyKvPagedPool):
    """A page pool that stores each key and value row quantized, as TinyKvQuantizedCache does.

    key_pages / value_pages hold the codes [capacity, H_kv, P, D * bits / 32] (uint32);
    key_scales, key_biases, value_scales, value_biases are [capacity, H_kv, P, D / group_size]
    in the float dtype. Rows go in and come out as floats: write() quantizes, gather()
    dequantizes. Allocation, freeing and growth are the float pool's, and a request's cache
    over it is the float TinyKvPagedCache.
    """

    def __init__(
        self, num_kv_heads: int, head_dim: int, *args, group_size: int = 64, bits: int = 8, **kwargs
    ):
        """args, kwargs: the float pool's page_size, max_pages and dtype (positional or not)."""
        check_quant_format(group_size, bits, "TinyKvQuantizedPagedPool")
        if head_dim % group_size != 0:
            raise ValueError(f"head_dim {head_dim} is not a multiple of group_size {group_size}")
        super().__init__(num_kv_heads, head_dim, *args, **kwargs)
        if self.read_in_place:
            raise ValueError(
                "quantized pages are read through gather: read_in_place needs float pages"
            )
        self.group_size, self.bits = group_size, bits
        page_size, dtype = self.page_size, self.dtype  # as the float pool took them
        codes = (0, num_kv_heads, page_size, head_dim * bits // 32)
        groups = (0, num_kv_heads, page_size, head_dim // group_size)
        self.key_pages = mx.zeros(codes, dtype=mx.uint32)
        self.value_pages = mx.zeros(codes, dtype=mx.uint32)
        self.key_scales, self.key_biases = mx.zeros(groups, dtype), mx.zeros(groups, dtype)
        self.value_scales, self.value_biases = mx.zeros(groups, dtype), mx.zeros(groups, dtype)

    @property
    def storage(self) -> list[mx.array]:
        return [
            self.key_pages,
            self.key_scales,
            self.key_biases,
            self.value_pages,
            self.value_scales,
            self.value_biases,
        ]

    def _resize(self, capacity: int) -> None:
        super()._resize(capacity)  # the codes
        self.key_scales = grown(self.key_scales, capacity)
        self.key_biases = grown(self.key_biases, capacity)
        self.value_scales = grown(self.value_scales, capacity)
        self.value_biases = grown(self.value_biases, capacity)

    def write(self, page: int, start: int, key: mx.array, value: mx.array) -> None:
        """Quantize key/value [H_kv, n, D] row by row and store them at slots start .. start + n
        of one page."""
        # BEGIN TASK Week 4 Day 1, Task 6: quantize the rows into the page's slots
        end = start + key.shape[1]
        codes, scales, biases = quantize(key, self.group_size, self.bits)  # [H_kv, n, *]
        self.key_pages[page, :, start:end, :] = codes
        self.key_scales[page, :, start:end, :] = scales
        self.key_biases[page, :, start:end, :] = biases
        codes, scales, biases = quantize(value, self.group_size, self.bits)
        self.value_pages[page, :, start:end, :] = codes
        self.value_scales[page, :, start:end, :] = scales
        self.value_biases[page, :, start:end, :] = biases
        # END TASK

    def gather(self, pages: list[int], length: int) -> tuple[mx.array, mx.array]:
        """The first `length` tokens stored in `pages`, dequantized: [H_kv, length, D] each."""
        # BEGIN TASK Week 4 Day 1, Task 6: read the pages back dequantized
        g, bits = self.group_size, self.bits
        read = lambda array: in_page_order(array, pages, length)  # [H_kv, length, X]
        keys = dequantize(
            read(self.key_pages), read(self.key_scales), read(self.key_biases), g, bits
        )
        values = dequantize(
            read(self.value_pages), read(self.value_scales), read(self.value_biases), g, bits
        )
        return keys, values
        # END TASK

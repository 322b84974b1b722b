"""Week 5 Day 2: decode rows attend through the course's own kernel, opt-in per pool.

paged_attention (Week 3 Day 5) walks page tables with MLX ops: a gather of a few pages per step,
a matmul, an exp, a merge, every step a new array. A decode row has one query, and the kernel
paged_decode_attention (csrc/paged_attention.cpp) does its whole walk in one pass over the pages,
in place, each key and value read once for a whole GQA group.

use_own_decode_kernel(pools) switches it on: paged_attention then hands its one-query rows (every
batched decode step, the decode rows of a ragged pass, a one-token prompt) to the pool's
decode_kernel, on the CPU; everything else (prefill, chunks, verify passes) stays as it was.
"""

import mlx.core as mx

from .kernels import paged_decode_attention
from .paged_kv_cache import TinyKvPagedPool


def own_decode_attention(
    query: mx.array,
    pool: TinyKvPagedPool,
    page_tables: list[list[int]],
    lengths: list[int],
    scale: float | None = None,
) -> mx.array:
    """paged_attention for one query per row, through the kernel: query [B, H_q, 1, D], row b
    over the first lengths[b] positions of the pages page_tables[b] of `pool` -> [B, H_q, 1, D].
    """
    # BEGIN TASK Week 5 Day 2, Task 4: decode rows through the kernel - pad the tables, one call
    width = max(len(table) for table in page_tables)
    tables = mx.array([t + [0] * (width - len(t)) for t in page_tables], dtype=mx.int32)
    out = paged_decode_attention(
        query[:, :, 0, :],  # [B, H_q, D]
        pool.key_pages,
        pool.value_pages,
        tables,  # [B, W], padded with page 0 (never read: past each row's length)
        mx.array(lengths, dtype=mx.int32),
        scale,
    )
    return out[:, :, None, :]
    # END TASK


def use_own_decode_kernel(pools: list[TinyKvPagedPool], on: bool = True) -> list[TinyKvPagedPool]:
    """Send the one-query rows of paged attention over these pools through the kernel (on=False:
    back to paged_attention's own walk). The pools must read in place (read_in_place=True):
    a pool read through gather never reaches paged_attention."""
    for pool in pools:
        if not getattr(pool, "read_in_place", False):
            raise ValueError(
                "the decode kernel reads pages in place: make the pools with read_in_place=True "
                f"(got a {type(pool).__name__} that gathers)"
            )
        pool.decode_kernel = own_decode_attention if on else None
    return pools

"""Week 5: the course's own kernels, written in C++ as MLX primitives (`csrc/`), called here.

The extension is built from this package's `csrc/` folder the first time a kernel is called,
and again only after a source file changed (tiny_llm_support.extension). Each function returns
a lazy mx.array like any MLX op: the kernel runs when the result is evaluated.
"""

from pathlib import Path

import mlx.core as mx

from tiny_llm_support.extension import load


class StandInWeight:
    """A weight that a kernel multiplies, standing in for the array where the model uses one:
    `w.shape`, `w.dtype`, `w.nbytes` and `w[rows]` are the wrapped weight's (a subclass adds the
    product that runs the kernel)."""

    def __init__(self, weight):
        self.weight = weight  # an mx.array, or a QuantizedWeight

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def dtype(self) -> mx.Dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __getitem__(self, rows) -> mx.array:
        return self.weight[rows]


def extension():
    """This package's C++ module, built first when its sources changed."""
    return load(Path(__file__).parent)


def quantized_matvec(
    x: mx.array,
    codes: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
    fast: bool = True,
) -> mx.array:
    """x [..., K] @ W.T -> [..., N] for W [N, K] in MLX's affine format (codes [N, K*bits/32]
    uint32, scales and biases [N, K/group_size] in x's dtype), on the CPU. fast=False runs the
    plain loop (Day 1, Task 1), fast=True the blocked, vectorized kernel (Tasks 2 and 3)."""
    return extension().quantized_matvec(x, codes, scales, biases, group_size, bits, fast)


def paged_decode_attention(
    q: mx.array,
    key_pages: mx.array,
    value_pages: mx.array,
    page_table: mx.array,
    lengths: mx.array,
    scale: float | None = None,
    fast: bool = True,
) -> mx.array:
    """Decode attention over page tables, on the CPU (Week 5 Day 2): q [B, H_q, D], one query
    per row; key_pages/value_pages [num_pages, H_kv, P, D] of a pool, read where they lie;
    page_table [B, W] int32 (rows padded past their last page), lengths [B] int32: row b sees
    its first lengths[b] positions -> [B, H_q, D]. scale defaults to 1 / sqrt(D). fast=False
    runs the plain walk (Task 1), fast=True the grouped, vectorized one (Tasks 2 and 3)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return extension().paged_decode_attention(
        q, key_pages, value_pages, page_table, lengths, scale, fast
    )


def grouped_matmul(x: mx.array, w: mx.array, experts: mx.array, fast: bool = True) -> mx.array:
    """y [M, N] with y[i] = x[i] @ w[experts[i]].T, on the CPU (Week 5 Day 3): x [M, K], the
    experts' weights stacked w [E, N, K] (x's dtype), experts [M] int sorted ascending (any
    order is correct, sorted is fast: each run of rows sharing an expert reads its weights once;
    a row whose expert is outside [0, E) comes out NaN). fast=False runs the plain loop (Task 1),
    fast=True the tiled kernel (Tasks 2 and 3)."""
    return extension().grouped_matmul(x, w, experts.astype(mx.int32), fast)


def few_row_matmul(x: mx.array, w: mx.array, fast: bool = True) -> mx.array:
    """x [..., K] @ w.T -> [..., N] for a float weight w [N, K] of x's dtype, on the CPU (Week 5
    Day 4): made for a few rows of x (1 to 16), each weight read once for all of them.
    fast=False runs the plain loop (Task 1), fast=True the tiled kernel (Tasks 2 and 3)."""
    return extension().few_row_matmul(x, w, fast)


def few_row_quantized_matmul(
    x: mx.array,
    codes: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
    fast: bool = True,
) -> mx.array:
    """few_row_matmul for a weight in MLX's affine format (codes [N, K*bits/32] uint32, scales
    and biases [N, K/group_size] in x's dtype), each code unpacked once for every row of x."""
    return extension().few_row_quantized_matmul(x, codes, scales, biases, group_size, bits, fast)

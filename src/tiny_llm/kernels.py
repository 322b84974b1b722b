"""Week 5: the course's own kernels, written in C++ as MLX primitives (`csrc/`), called here.

The extension is built from this package's `csrc/` folder the first time a kernel is called,
and again only after a source file changed (tiny_llm_support.extension). Each function returns
a lazy mx.array like any MLX op: the kernel runs when the result is evaluated.
"""

from pathlib import Path

import mlx.core as mx

from tiny_llm_support.extension import load


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

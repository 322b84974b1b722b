"""Week 1 Day 2: rotary position embeddings (RoPE) with a position offset."""

import mlx.core as mx


class RoPE:
    """Rotates pairs of features by an angle proportional to the token position.

    traditional=False pairs feature i with i + D/2 (Qwen's half-split layout);
    traditional=True pairs features 2i and 2i + 1.
    """

    def __init__(self, dims: int, seq_len: int, base: float = 10000.0, traditional: bool = False):
        raise NotImplementedError("Week 1 Day 2, Task 1: precompute the RoPE cos/sin tables")

    def __call__(self, x: mx.array, offset: int | list[int] = 0) -> mx.array:
        """x [B, L, H, D]; offset: the position of x[:, 0] (one int, or one per row)."""
        raise NotImplementedError("Week 1 Day 2, Task 2: rotate x by its positions starting at offset")

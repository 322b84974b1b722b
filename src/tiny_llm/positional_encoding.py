"""Week 1 Day 2: rotary position embeddings (RoPE) with a position offset."""

import mlx.core as mx


class RoPE:
    """Rotates pairs of features by an angle proportional to the token position.

    traditional=False pairs feature i with i + D/2 (Qwen's half-split layout);
    traditional=True pairs features 2i and 2i + 1.
    """

    def __init__(self, dims: int, seq_len: int, base: float = 10000.0, traditional: bool = False):
        raise NotImplementedError("Week 1 Day 2, Task 1: precompute the RoPE cos/sin tables")

    def positions(self, offset: int | list[int], batch: int, length: int) -> mx.array:
        """[B, L] positions of `length` tokens per row starting at offset (one int for every
        row, or one per row), checked against the table."""
        raise NotImplementedError(
            "Week 1 Day 2, Task 2: positions from one offset or one offset per row"
        )

    def __call__(self, x: mx.array, offset: int | list[int] | mx.array = 0) -> mx.array:
        """x [B, L, H, D] rotated by its positions: offset is the position of x[:, 0] (one int,
        or one per row), or an array of every token's position, [B, L] (Week 3 Day 3)."""
        raise NotImplementedError("Week 1 Day 2, Task 3: rotate x by its positions")

"""Week 1 Day 2: rotary position embeddings (RoPE) with a position offset."""

import mlx.core as mx


class RoPE:
    """Rotates pairs of features by an angle proportional to the token position.

    traditional=False pairs feature i with i + D/2 (Qwen's half-split layout);
    traditional=True pairs features 2i and 2i + 1.
    """

    def __init__(self, dims: int, seq_len: int, base: float = 10000.0, traditional: bool = False):
        # BEGIN TASK Week 1 Day 2, Task 1: precompute the RoPE cos/sin tables
        if dims % 2 != 0:
            raise ValueError(f"RoPE needs an even number of dims, got {dims}")
        self.dims = dims
        self.seq_len = seq_len
        self.traditional = traditional
        half = dims // 2
        inv_freq = 1.0 / (base ** (mx.arange(0, half, dtype=mx.float32) / half))  # [D/2]
        angles = mx.arange(seq_len, dtype=mx.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
        self.cos = mx.cos(angles)
        self.sin = mx.sin(angles)
        # END TASK

    def positions(self, offset: int | list[int], batch: int, length: int) -> mx.array:
        """[B, L] positions of `length` tokens per row starting at offset (one int for every
        row, or one per row), checked against the table."""
        # BEGIN TASK Week 1 Day 2, Task 2: positions from one offset or one offset per row
        starts = [offset] * batch if isinstance(offset, int) else list(offset)
        if len(starts) != batch:
            raise ValueError(f"{len(starts)} offsets for a batch of {batch} rows")
        if min(starts) < 0 or max(starts) + length > self.seq_len:
            raise ValueError(
                f"positions {min(starts)}..{max(starts) + length - 1} are outside the RoPE table "
                f"of {self.seq_len} positions"
            )
        return mx.array(starts)[:, None] + mx.arange(length)[None, :]  # [B, L]
        # END TASK

    def __call__(self, x: mx.array, offset: int | list[int] | mx.array = 0) -> mx.array:
        """x [B, L, H, D] rotated by its positions: offset is the position of x[:, 0] (one int,
        or one per row), or an array of every token's position, [B, L] (Week 3 Day 3)."""
        # BEGIN TASK Week 1 Day 2, Task 3: rotate x by its positions
        b, l, _, d = x.shape
        if d != self.dims:
            raise ValueError(f"RoPE was built for {self.dims} dims, got {d}")
        positions = offset if isinstance(offset, mx.array) else self.positions(offset, b, l)
        cos = self.cos[positions][:, :, None, :]  # [B, L, 1, D/2]
        sin = self.sin[positions][:, :, None, :]
        if self.traditional:
            x1, x2 = x[..., 0::2], x[..., 1::2]  # [B, L, H, D/2]
        else:
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        if self.traditional:
            y = mx.stack([y1, y2], axis=-1).reshape(x.shape)
        else:
            y = mx.concatenate([y1, y2], axis=-1)
        return y.astype(x.dtype)
        # END TASK

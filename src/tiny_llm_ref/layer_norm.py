"""Week 1 Day 4: RMSNorm."""

import mlx.core as mx


class RMSNorm:
    """y = x / sqrt(mean(x^2) + eps) * weight, accumulated in float32."""

    def __init__(self, dim: int, weight: mx.array, eps: float = 1e-6):
        if weight.shape != (dim,):
            raise ValueError(f"RMSNorm weight has shape {weight.shape}, expected ({dim},)")
        self.dim = dim
        self.weight = weight
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        # BEGIN TASK Week 1 Day 4, Task 1: implement RMSNorm
        x32 = x.astype(mx.float32)  # [..., D]
        inv_rms = mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)  # [..., 1]
        return (self.weight.astype(mx.float32) * (x32 * inv_rms)).astype(x.dtype)
        # END TASK

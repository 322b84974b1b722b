"""Week 1 Day 1: the small array helpers every later module uses."""

import mlx.core as mx


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Numerically stable softmax, computed in float32 and cast back."""
    x32 = x.astype(mx.float32)
    # Subtracting the row maximum keeps exp() <= 1, so huge logits cannot overflow.
    shifted = x32 - mx.max(x32, axis=axis, keepdims=True)
    e = mx.exp(shifted)
    return (e / mx.sum(e, axis=axis, keepdims=True)).astype(x.dtype)


def linear(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x [..., I] times a weight stored as [O, I] (the checkpoint layout) -> [..., O]."""
    y = x @ w.T
    if bias is not None:
        y = y + bias
    return y


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), the gate activation of the SwiGLU MLP."""
    return x * mx.sigmoid(x)

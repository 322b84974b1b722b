"""Week 1 Day 1: the small array helpers every later module uses. Week 4 Day 1 lets `linear`
take a quantized weight."""

import mlx.core as mx

from .quantize import QuantizedWeight


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Numerically stable softmax, computed in float32 and cast back."""
    # BEGIN TASK Week 1 Day 1, Task 1: implement a numerically stable softmax
    x32 = x.astype(mx.float32)
    # Subtracting the row maximum keeps exp() <= 1, so huge logits cannot overflow.
    shifted = x32 - mx.max(x32, axis=axis, keepdims=True)
    e = mx.exp(shifted)
    return (e / mx.sum(e, axis=axis, keepdims=True)).astype(x.dtype)
    # END TASK


def linear(x: mx.array, w: mx.array | QuantizedWeight, bias: mx.array | None = None) -> mx.array:
    """x [..., I] times a weight stored as [O, I] (the checkpoint layout) -> [..., O]."""
    if not isinstance(w, mx.array):  # a weight that multiplies itself: a QuantizedWeight
        y = w.linear(x)  # (Week 4 Day 1) or a FewRowWeight (Week 5 Day 4)
        return y if bias is None else y + bias
    # BEGIN TASK Week 1 Day 1, Task 2: implement linear (x @ w.T + bias)
    y = x @ w.T
    if bias is not None:
        y = y + bias
    return y
    # END TASK


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), the gate activation of the SwiGLU MLP."""
    # BEGIN TASK Week 1 Day 4, Task 2: implement silu
    return x * mx.sigmoid(x)
    # END TASK

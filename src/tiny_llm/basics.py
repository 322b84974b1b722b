"""Week 1 Day 1: the small array helpers every later module uses. Week 4 Day 1 lets `linear`
take a quantized weight."""

import mlx.core as mx

from .quantize import QuantizedWeight


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Numerically stable softmax, computed in float32 and cast back."""
    raise NotImplementedError("Week 1 Day 1, Task 1: implement a numerically stable softmax")


def linear(x: mx.array, w: mx.array | QuantizedWeight, bias: mx.array | None = None) -> mx.array:
    """x [..., I] times a weight stored as [O, I] (the checkpoint layout) -> [..., O]."""
    if not isinstance(w, mx.array):  # a weight that multiplies itself: a QuantizedWeight
        y = w.linear(x)  # (Week 4 Day 1) or a FewRowWeight (Week 5 Day 4)
        return y if bias is None else y + bias
    raise NotImplementedError("Week 1 Day 1, Task 2: implement linear (x @ w.T + bias)")


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), the gate activation of the SwiGLU MLP."""
    raise NotImplementedError("Week 1 Day 4, Task 2: implement silu")

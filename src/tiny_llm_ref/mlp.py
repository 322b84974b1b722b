"""Week 1 Day 4: the SwiGLU feed-forward block of Qwen3."""

import mlx.core as mx

from .basics import linear, silu


class Qwen3MLP:
    """down(silu(gate(x)) * up(x)); weights in [out, in] layout."""

    def __init__(
        self, dim: int, hidden_dim: int, w_gate: mx.array, w_up: mx.array, w_down: mx.array
    ):
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down

    def __call__(self, x: mx.array) -> mx.array:
        # BEGIN TASK Week 1 Day 4, Task 3: implement the SwiGLU MLP
        gate = silu(linear(x, self.w_gate))  # [..., I]
        return linear(gate * linear(x, self.w_up), self.w_down)  # [..., E]
        # END TASK

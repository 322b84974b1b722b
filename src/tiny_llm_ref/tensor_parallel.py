"""Week 4 Day 2: the parallel layers, each holding one rank's share of a weight.

Every rank of an mx.distributed group holds a share of every transformer block and runs the
same tokens:

- a column-parallel linear keeps a slice of the output features (rows of the [O, I] weight)
  and needs no communication: its output is this rank's slice of the full output;
- a row-parallel linear keeps the matching slice of the input features (columns of the
  weight); each rank's product is a partial sum, and all_sum over the ranks completes it.

A SwiGLU MLP is one such pair: gate/up column-parallel, down_proj row-parallel. These layers
know nothing of Qwen3. Where to cut a model (which heads, which features) is the model's own
knowledge, so the model shards itself with them (qwen3.py: TensorParallelAttention,
shard_blocks, Qwen3Model.shard), as mlx-lm's models apply MLX's shard_linear to their own
linears. qwen3.py imports this module, and this module never imports qwen3.py.
"""

import mlx.core as mx

from .basics import linear, silu
from .mlp import Qwen3MLP


def keep(part: mx.array) -> mx.array:
    """A slice of a weight as an array of its own, computed now: it does not keep the full
    weight alive, so once the caller drops the checkpoint a rank holds only its share."""
    part = mx.contiguous(part)
    mx.eval(part)
    return part


def rank_slice(size: int, group: mx.distributed.Group, what: str) -> slice:
    """This rank's part of an axis of `size` items (heads, features): the group.rank()-th of
    group.size() equal, contiguous parts. ValueError names `what` when it does not divide."""
    # BEGIN TASK Week 4 Day 2, Task 1: this rank's equal share of an axis
    n = group.size()
    if size % n != 0:
        raise ValueError(f"{what}: {size} does not divide by the group size {n}")
    part = size // n
    return slice(group.rank() * part, (group.rank() + 1) * part)
    # END TASK


class ColumnParallelLinear:
    """x @ W.T for this rank's slice of the output features; no communication.

    weight: the full [O, I] tensor; kept: [O / N, I]. The output [..., O / N] is this rank's
    slice of the full output, so concatenating the ranks' outputs gives x @ W.T.
    """

    def __init__(self, weight: mx.array, group: mx.distributed.Group):
        # BEGIN TASK Week 4 Day 2, Task 1: keep this rank's output features (column-parallel)
        rows = rank_slice(weight.shape[0], group, "output features")
        self.weight = keep(weight[rows])
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        return linear(x, self.weight)  # [..., I] -> [..., O / N]


class RowParallelLinear:
    """x @ W.T from this rank's slice of the input features, summed over the ranks.

    weight: the full [O, I] tensor; kept: [O, I / N]. The input is this rank's slice
    [..., I / N] (what a column-parallel layer before it produced); every rank gets the whole
    output [..., O].
    """

    def __init__(self, weight: mx.array, group: mx.distributed.Group):
        self.group = group
        # BEGIN TASK Week 4 Day 2, Task 1: keep this rank's input features (row-parallel)
        cols = rank_slice(weight.shape[1], group, "input features")
        self.weight = keep(weight[:, cols])
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        # BEGIN TASK Week 4 Day 2, Task 1: a partial product on each rank, summed over the ranks
        return mx.distributed.all_sum(linear(x, self.weight), group=self.group)  # [..., O]
        # END TASK


class TensorParallelMLP:
    """This rank's share of the SwiGLU MLP: I / N of the intermediate features."""

    def __init__(self, mlp: Qwen3MLP, group: mx.distributed.Group):
        # BEGIN TASK Week 4 Day 2, Task 3: gate/up column-parallel, down_proj row-parallel
        self.gate_proj = ColumnParallelLinear(mlp.w_gate, group)  # [I / N, E]
        self.up_proj = ColumnParallelLinear(mlp.w_up, group)  # [I / N, E]
        self.down_proj = RowParallelLinear(mlp.w_down, group)  # [E, I / N]
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        # BEGIN TASK Week 4 Day 2, Task 3: the MLP over this rank's intermediate features
        gate = silu(self.gate_proj(x))  # [..., I / N]
        return self.down_proj(gate * self.up_proj(x))  # [..., E], summed over the ranks
        # END TASK

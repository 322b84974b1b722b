"""Week 4 Day 2: tensor parallelism over an mx.distributed group.

Every rank of the group holds a share of every transformer block and runs the same tokens:

- a column-parallel linear keeps a slice of the output features (rows of the [O, I] weight)
  and needs no communication: its output is this rank's slice of the full output;
- a row-parallel linear keeps the matching slice of the input features (columns of the
  weight); each rank's product is a partial sum, and all_sum over the ranks completes it.

Attention is cut on head boundaries (q/k/v column-parallel, o_proj row-parallel) and the MLP
on its intermediate features (gate/up column-parallel, down_proj row-parallel): two all_sums
per block, and each rank's KV cache holds only its own KV heads. The embeddings, the norms and
the output head stay whole (replicated) on every rank.
"""

import mlx.core as mx

from tiny_llm_support import Qwen3Config

from .basics import linear, silu
from .mlp import Qwen3MLP
from .qwen3 import Qwen3AttentionWithCache, Qwen3BlockWithCache


def keep(part: mx.array) -> mx.array:
    """A slice of a weight as an array of its own, computed now: it does not keep the full
    weight alive, so once the caller drops the checkpoint a rank holds only its share."""
    part = mx.contiguous(part)
    mx.eval(part)
    return part


def rank_slice(size: int, group: mx.distributed.Group, what: str) -> slice:
    """This rank's part of an axis of `size` items (heads, features): the group.rank()-th of
    group.size() equal, contiguous parts. ValueError names `what` when it does not divide."""
    raise NotImplementedError("Week 4 Day 2, Task 1: this rank's equal share of an axis")


class ColumnParallelLinear:
    """x @ W.T for this rank's slice of the output features; no communication.

    weight: the full [O, I] tensor; kept: [O / N, I]. The output [..., O / N] is this rank's
    slice of the full output, so concatenating the ranks' outputs gives x @ W.T.
    """

    def __init__(self, weight: mx.array, group: mx.distributed.Group):
        raise NotImplementedError(
            "Week 4 Day 2, Task 1: keep this rank's output features (column-parallel)"
        )

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
        raise NotImplementedError(
            "Week 4 Day 2, Task 1: keep this rank's input features (row-parallel)"
        )

    def __call__(self, x: mx.array) -> mx.array:
        raise NotImplementedError(
            "Week 4 Day 2, Task 1: a partial product on each rank, summed over the ranks"
        )


class TensorParallelAttention(Qwen3AttentionWithCache):
    """This rank's heads of one attention layer.

    The query heads and the KV heads they read are split in rank order (H / N query heads and
    H_kv / N KV heads each, so every query head finds its KV head on the same rank), which
    makes q/k/v column-parallel on head boundaries and o_proj row-parallel. qkv and attend are
    the base class's, run over fewer heads: the cache only ever sees this rank's KV heads.
    """

    def __init__(self, attn: Qwen3AttentionWithCache, group: mx.distributed.Group):
        self.q_norm, self.k_norm, self.rope = attn.q_norm, attn.k_norm, attn.rope
        self.head_dim = attn.head_dim
        raise NotImplementedError("Week 4 Day 2, Task 2: keep this rank's query and KV heads")

    def __call__(
        self,
        x: mx.array,
        offset: int | list[int],
        cache,
        mask: mx.array | str | None = None,
    ) -> mx.array:
        """x [B, L, E] (the same on every rank) -> [B, L, E], summed over the ranks."""
        raise NotImplementedError("Week 4 Day 2, Task 2: attention over this rank's heads")

    def project(self, out: mx.array) -> mx.array:
        """This rank's heads' outputs [B, H / N, L, D] -> [B, L, E], the row-parallel o_proj."""
        raise NotImplementedError("Week 4 Day 2, Task 2: the row-parallel output projection")


class TensorParallelMLP:
    """This rank's share of the SwiGLU MLP: I / N of the intermediate features."""

    def __init__(self, mlp: Qwen3MLP, group: mx.distributed.Group):
        raise NotImplementedError(
            "Week 4 Day 2, Task 3: gate/up column-parallel, down_proj row-parallel"
        )

    def __call__(self, x: mx.array) -> mx.array:
        raise NotImplementedError(
            "Week 4 Day 2, Task 3: the MLP over this rank's intermediate features"
        )


def shard_blocks(
    config: Qwen3Config, blocks: list[Qwen3BlockWithCache], group: mx.distributed.Group
) -> list[Qwen3BlockWithCache]:
    """This rank's share of every block: the same block class around a tensor-parallel
    attention and MLP (norms replicated). Every size the group splits is checked first, so a
    group that does not fit changes nothing."""
    raise NotImplementedError("Week 4 Day 2, Task 4: check every split, then shard every block")

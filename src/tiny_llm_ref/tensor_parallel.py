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
        # BEGIN TASK Week 4 Day 2, Task 2: keep this rank's query and KV heads
        n = group.size()
        rank_slice(attn.num_heads, group, "query heads")  # raises unless the heads divide by n
        rank_slice(attn.num_kv_heads, group, "KV heads")
        self.num_heads, self.num_kv_heads = attn.num_heads // n, attn.num_kv_heads // n
        # the inherited qkv() reads self.wq, self.wk and self.wv: this rank's rows of each
        self.wq = ColumnParallelLinear(attn.wq, group).weight  # [H / N * D, E]
        self.wk = ColumnParallelLinear(attn.wk, group).weight  # [H_kv / N * D, E]
        self.wv = ColumnParallelLinear(attn.wv, group).weight
        self.o_proj = RowParallelLinear(attn.wo, group)  # [E, H / N * D]
        # END TASK

    def __call__(
        self,
        x: mx.array,
        offset: int | list[int],
        cache,
        mask: mx.array | str | None = None,
    ) -> mx.array:
        """x [B, L, E] (the same on every rank) -> [B, L, E], summed over the ranks."""
        # BEGIN TASK Week 4 Day 2, Task 2: attention over this rank's heads
        q, k, v = self.qkv(x, offset)  # [B, H / N, L, D], [B, H_kv / N, L, D]
        return self.project(self.attend(q, k, v, cache, mask))
        # END TASK

    def project(self, out: mx.array) -> mx.array:
        """This rank's heads' outputs [B, H / N, L, D] -> [B, L, E], the row-parallel o_proj."""
        # BEGIN TASK Week 4 Day 2, Task 2: the row-parallel output projection
        b, _, l, _ = out.shape
        return self.o_proj(out.swapaxes(1, 2).reshape(b, l, -1))
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


def shard_blocks(
    config: Qwen3Config, blocks: list[Qwen3BlockWithCache], group: mx.distributed.Group
) -> list[Qwen3BlockWithCache]:
    """This rank's share of every block: the same block class around a tensor-parallel
    attention and MLP (norms replicated). Every size the group splits is checked first, so a
    group that does not fit changes nothing."""
    # BEGIN TASK Week 4 Day 2, Task 4: check every split, then shard every block
    rank_slice(config.num_attention_heads, group, "num_attention_heads")
    rank_slice(config.num_key_value_heads, group, "num_key_value_heads")
    rank_slice(config.intermediate_size, group, "intermediate_size")
    sharded = [
        Qwen3BlockWithCache(
            TensorParallelAttention(block.self_attn, group),
            TensorParallelMLP(block.mlp, group),
            block.input_layernorm,
            block.post_attention_layernorm,
        )
        for block in blocks
    ]
    return sharded
    # END TASK

"""Week 4 Day 6: a mixture of experts, the feed-forward block of Qwen3-MoE.

A sparse layer holds E experts, each a SwiGLU MLP of its own (Week 1 Day 4), and a router: a
linear layer that gives every token one logit per expert. Each token runs through only the k
experts with the highest router probabilities, and the block's output is their outputs
weighted by those probabilities:

    p = softmax(x @ W_router.T)                    [N, E]
    chosen = the k largest entries of p            [N, k] expert ids, [N, k] weights
    y = sum over the chosen j of weight_j * expert_j(x)

The experts' weights are stacked along a first axis: gate and up [E, I, H], down [E, H, I].
Two ways to run them: a loop over the experts (each on the tokens routed to it), and a grouped
version that sorts the (token, expert) pairs by expert and multiplies every pair by its
expert's weights in one gathered matmul (mx.gather_mm). Expert parallelism splits the experts
over the ranks of a group: each rank runs its own experts and all_sum adds up the outputs.
"""

import mlx.core as mx
import numpy as np

from .basics import linear, silu
from .kernels import StandInWeight, grouped_matmul
from .quantize import QuantizedWeight
from .tensor_parallel import keep, rank_slice

EXPERT_MATMULS = ("gather-mm", "own-kernel")  # how the grouped pairs multiply (Week 5 Day 3)


class OwnKernelExperts(StandInWeight):
    """A float expert stack [E, out, in] whose gathered matmul (gather_linear) runs the course's
    grouped_matmul kernel (Week 5 Day 3) instead of mx.gather_mm. It stands in for the array where
    the block uses one, as QuantizedWeight does for a quantized weight: `w.shape`, `w.dtype`,
    `w[e]` (expert e's matrix, for experts_loop)."""

    def gather_linear(self, x: mx.array, experts: mx.array) -> mx.array:
        """x [M, 1, in] @ W[experts[m]].T for every m -> [M, 1, out]; experts [M] sorted."""
        # BEGIN TASK Week 5 Day 3, Task 4: the sorted pairs through grouped_matmul, one row per pair
        m = x.shape[0]
        y = grouped_matmul(x.reshape(m, x.shape[-1]), self.weight, experts)  # [M, out]
        return y.reshape(m, 1, -1)
        # END TASK


Stack = mx.array | QuantizedWeight | OwnKernelExperts  # the experts stacked [E, out, in]


def route(logits: mx.array, k: int, norm_topk_prob: bool) -> tuple[mx.array, mx.array]:
    """Router logits [N, E] -> the k chosen experts of each token [N, k] (int) and their
    weights [N, k]: softmax probabilities, renormalized to sum to 1 when norm_topk_prob."""
    # BEGIN TASK Week 4 Day 6, Task 1: route each token to its k most probable experts
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)  # [N, E], in float32 like mlx-lm
    experts = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # [N, k], in no order
    weights = mx.take_along_axis(probs, experts, axis=-1)  # [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts, weights.astype(logits.dtype)
    # END TASK


def expert_swiglu(x: mx.array, w_gate: mx.array, w_up: mx.array, w_down: mx.array) -> mx.array:
    """One expert's SwiGLU: x [n, H] with its gate/up [I, H] and down [H, I] -> [n, H]."""
    return linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def experts_loop(
    x: mx.array,
    experts: mx.array,
    weights: mx.array,
    w_gate: mx.array,
    w_up: mx.array,
    w_down: mx.array,
) -> mx.array:
    """x [N, H], experts and weights [N, k] -> [N, H]: for each expert that received tokens,
    its SwiGLU on those tokens, weighted and added to each token's output."""
    # BEGIN TASK Week 4 Day 6, Task 2: the experts one by one, each on the tokens routed to it
    out = mx.zeros(x.shape, dtype=x.dtype)  # [N, H]
    chosen = np.array(experts)  # [N, k]: which tokens go where is decided on the host
    for e in np.unique(chosen):
        tokens, slots = np.nonzero(chosen == e)  # the (token, slot) pairs routed to expert e
        tokens, slots = mx.array(tokens), mx.array(slots)
        y = expert_swiglu(x[tokens], w_gate[int(e)], w_up[int(e)], w_down[int(e)])  # [n, H]
        out = out.at[tokens].add(y * weights[tokens, slots][:, None])
    return out
    # END TASK


def gather_linear(x: mx.array, w: Stack, experts: mx.array) -> mx.array:
    """x [M, 1, in] @ W[experts[m]].T for every m -> [M, 1, out], from stacked weights
    w [E, out, in] (float, or a QuantizedWeight and MLX's quantized kernel, or OwnKernelExperts
    and the course's kernel); experts [M] sorted."""
    if isinstance(w, OwnKernelExperts):
        return w.gather_linear(x, experts)
    if isinstance(w, QuantizedWeight):
        return mx.gather_qmm(
            x, w.codes, w.scales, w.biases, rhs_indices=experts, transpose=True,
            group_size=w.group_size, bits=w.bits, sorted_indices=True,
        )  # fmt: skip
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)


def experts_grouped(
    x: mx.array, experts: mx.array, weights: mx.array, w_gate: Stack, w_up: Stack, w_down: Stack
) -> mx.array:
    """What experts_loop computes, with the N * k (token, expert) pairs run by run_pairs: one
    gathered matmul per projection, however many experts the tokens chose."""
    n, k = experts.shape
    tokens = mx.repeat(mx.arange(n), k)  # pair m is token m // k, slot m % k
    y = run_pairs(x, tokens, experts.reshape(-1), w_gate, w_up, w_down).reshape(n, k, -1)
    return (y * weights[..., None]).sum(axis=1)  # [N, H]


def run_pairs(
    x: mx.array, tokens: mx.array, experts: mx.array, w_gate: Stack, w_up: Stack, w_down: Stack
) -> mx.array:
    """x [N, H]; pairs: token ids and expert ids [M] -> each pair's expert SwiGLU [M, H], in
    the pairs' order. The pairs are sorted by expert first, so that each expert's weights are
    read once for all its tokens, and the outputs are put back in order at the end."""
    # BEGIN TASK Week 4 Day 6, Task 3: sort the pairs by expert, gathered matmuls, unsort
    order = mx.argsort(experts)  # the pairs grouped by expert
    xs = x[tokens[order]][:, None, :]  # [M, 1, H], each pair's token
    ids = experts[order]
    h = silu(gather_linear(xs, w_gate, ids)) * gather_linear(xs, w_up, ids)  # [M, 1, I]
    y = gather_linear(h, w_down, ids)[:, 0, :]  # [M, H], in expert order
    return y[mx.argsort(order)]  # back in the pairs' order
    # END TASK


class Qwen3SparseMoE:
    """The mixture-of-experts block of a sparse Qwen3-MoE layer: x [..., H] -> [..., H].

    w_router [E, H]; w_gate, w_up [E, I, H] and w_down [E, H, I], the experts stacked.
    grouped: True runs the experts with experts_grouped, False with experts_loop, None (the
    default) picks per call, as measured (chapter 4.6, use_grouped). set_expert_matmul
    ("own-kernel") runs the grouped pairs through the course's kernel (Week 5 Day 3).
    """

    def __init__(
        self,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
        w_router: mx.array,
        w_gate: mx.array,
        w_up: mx.array,
        w_down: mx.array,
    ):
        self.top_k, self.norm_topk_prob = num_experts_per_tok, norm_topk_prob
        self.w_router = w_router
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.grouped: bool | None = None

    def use_grouped(self, pairs: int) -> bool:
        """Whether `pairs` (token, expert) pairs run grouped. On a GPU, gather_mm multiplies all
        of an expert's rows at once: always. On the CPU it multiplies one pair at a time, each
        reading its expert's weights again, so it wins only while there are no more pairs than
        experts (decode); a prefill's thousands of pairs run faster as a loop over experts."""
        if self.grouped is not None:
            return self.grouped
        if isinstance(self.w_gate, OwnKernelExperts):
            return True  # the course's kernel reads an expert's weights once per run (5.3)
        return mx.default_device().type == mx.gpu or pairs <= self.w_gate.shape[0]

    def set_expert_matmul(self, path: str) -> None:
        """How the grouped pairs multiply, one of EXPERT_MATMULS: "gather-mm" (mx.gather_mm,
        chapter 4.6) or "own-kernel" (grouped_matmul, Week 5 Day 3; float stacks on the CPU
        only: a quantized stack keeps mx.gather_qmm)."""
        if path not in EXPERT_MATMULS:
            raise ValueError(f"unknown expert_matmul {path!r}: use one of {EXPERT_MATMULS}")
        own = path == "own-kernel" and mx.default_device().type == mx.cpu
        stacks = []
        for w in (self.w_gate, self.w_up, self.w_down):
            w = w.weight if isinstance(w, OwnKernelExperts) else w
            stacks.append(OwnKernelExperts(w) if own and isinstance(w, mx.array) else w)
        self.w_gate, self.w_up, self.w_down = stacks

    def __call__(self, x: mx.array) -> mx.array:
        # BEGIN TASK Week 4 Day 6, Task 4: route every token and run its experts
        flat = x.reshape(-1, x.shape[-1])  # [N, H], every token of every row
        experts, weights = route(linear(flat, self.w_router), self.top_k, self.norm_topk_prob)
        run = experts_grouped if self.use_grouped(experts.size) else experts_loop
        out = run(flat, experts, weights, self.w_gate, self.w_up, self.w_down)
        return out.reshape(x.shape)
        # END TASK


class ExpertParallelMoE(Qwen3SparseMoE):
    """This rank's experts of a sparse block (expert parallelism, Week 4 Day 6 on 4.2's groups).

    Every rank routes every token over all E experts (the router stays whole), keeps E / N
    experts (whole, unlike tensor parallelism, which would keep a slice of every expert), runs
    the pairs routed to its own experts, and all_sum adds the ranks' outputs: each pair is
    computed on exactly one rank.
    """

    def __init__(self, moe: Qwen3SparseMoE, group: mx.distributed.Group):
        super().__init__(
            moe.top_k, moe.norm_topk_prob, moe.w_router, moe.w_gate, moe.w_up, moe.w_down
        )
        self.group = group
        # BEGIN TASK Week 4 Day 6, Task 5: keep this rank's experts
        mine = rank_slice(moe.w_gate.shape[0], group, "num_experts")
        self.first = mine.start
        self.w_gate, self.w_up, self.w_down = (
            keep(w[mine]) for w in (moe.w_gate, moe.w_up, moe.w_down)
        )  # [E / N, ...]
        # END TASK

    def __call__(self, x: mx.array) -> mx.array:
        # BEGIN TASK Week 4 Day 6, Task 5: run the pairs routed here, sum over the ranks
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        experts, weights = route(linear(flat, self.w_router), self.top_k, self.norm_topk_prob)
        chosen = np.array(experts).astype(np.int64)  # [N, k], signed: uint32 ids would wrap
        local = chosen - self.first  # this rank's expert ids when in range
        tokens, slots = np.nonzero((local >= 0) & (local < self.w_gate.shape[0]))
        out = mx.zeros(flat.shape, dtype=flat.dtype)
        if len(tokens):  # the pairs routed to this rank's experts, none of the others
            ids = mx.array(local[tokens, slots])
            tokens, slots = mx.array(tokens), mx.array(slots)
            y = run_pairs(flat, tokens, ids, self.w_gate, self.w_up, self.w_down)  # [M, H]
            out = out.at[tokens].add(y * weights[tokens, slots][:, None])
        return mx.distributed.all_sum(out, group=self.group).reshape(x.shape)
        # END TASK

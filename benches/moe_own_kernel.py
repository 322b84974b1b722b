"""5.3: the own-kernel variant of bench-moe (--own-kernel): the sparse block grouped through the
course's grouped_matmul kernel, and where its prefill time goes."""

from typing import Any

import mlx.core as mx
import numpy as np

from benches import harness
from benches.ceilings import timed

OWN_KERNEL = "own-kernel"  # --own-kernel: grouped through grouped_matmul (Week 5 Day 3)


def own_kernel_moe(moe):
    """A sparse block run grouped through the course's kernel."""
    moe.grouped = True
    moe.set_expert_matmul("own-kernel")
    return moe


def kernel_breakdown(pkg, moe, x: mx.array, repeats: int, block_s: float) -> dict[str, Any]:
    """Where own-kernel's block time goes at prefill: its three grouped_matmul calls timed alone
    on the pairs this block routes, sorted by expert, against the block's median (block_s); the
    rest is the block's MLX ops around them (router, sort, gathers, SwiGLU, weighted sum)."""
    flat = x.reshape(-1, x.shape[-1])  # [N, H]
    experts, _ = pkg.route(flat @ moe.w_router.T, moe.top_k, moe.norm_topk_prob)  # [N, k]
    ids = experts.reshape(-1)
    order = mx.argsort(ids)
    tokens = mx.repeat(mx.arange(flat.shape[0]), experts.shape[1])[order]
    xs, ids = flat[tokens], ids[order].astype(mx.int32)  # [M, H], [M] sorted
    h = mx.random.normal((xs.shape[0], moe.w_gate.shape[1]), key=mx.random.key(1))  # [M, I]
    mx.eval(xs, ids, h)
    calls = {"gate": (xs, moe.w_gate.weight), "up": (xs, moe.w_up.weight),
             "down": (h, moe.w_down.weight)}  # fmt: skip
    out: dict[str, Any] = {"pairs": xs.shape[0], "runs": len(np.unique(np.array(ids))),
                           "block_s": block_s, "calls": {}}  # fmt: skip
    for name, (a, w) in calls.items():
        times = [timed(lambda a=a, w=w: pkg.grouped_matmul(a, w, ids)) for _ in range(repeats + 1)]
        t = harness.median(times[1:])  # the first one warms up
        flops = 2 * a.shape[0] * a.shape[1] * w.shape[1]
        out["calls"][name] = {"shape": [a.shape[0], w.shape[1], a.shape[1]], "samples_s": times[1:],
                              "median_s": t, "gflop_per_s": flops / t / 1e9}  # fmt: skip
    kernel = sum(c["median_s"] for c in out["calls"].values())
    flops = sum(c["gflop_per_s"] * c["median_s"] for c in out["calls"].values())
    out.update({"kernel_s": kernel, "kernel_share": kernel / block_s, "rest_s": block_s - kernel,
                "kernel_gflop_per_s": flops / kernel})  # fmt: skip
    harness.log(f"  own-kernel prefill: grouped_matmul {kernel * 1000:.0f} ms of "
                f"{block_s * 1000:.0f} ms ({flops / kernel:.0f} GFLOP/s)")  # fmt: skip
    return out

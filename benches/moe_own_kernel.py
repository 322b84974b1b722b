"""5.3: the own-kernel variant of bench-moe (--own-kernel): the sparse block grouped through the
course's grouped_matmul kernel, where its prefill time goes, and its two targets (chapter 5.3).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import numpy as np

from benches import harness

OWN_KERNEL = "own-kernel"  # --own-kernel: grouped through grouped_matmul (Week 5 Day 3)
TARGET_OWN_OVER_LOOP = 3.0  # block prefill: loop's time / own-kernel's time, at least
TARGET_OWN_OVER_GROUPED_DECODE = 1.0  # block decode rows: own-kernel's / grouped's, at most


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
        times = []
        for _ in range(repeats + 1):  # the first one warms up
            start = time.perf_counter()
            mx.eval(pkg.grouped_matmul(a, w, ids))
            times.append(time.perf_counter() - start)
        t = harness.median(times[1:])
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


def own_kernel_targets(at: dict[tuple[str, str], float], block: list[dict]) -> dict[str, Any]:
    """The issue's targets for the own-kernel rows of the block table (none without them)."""
    prefill = block[0]["label"]
    if (prefill, OWN_KERNEL) not in at:
        return {}
    own = at[(prefill, "loop")] / at[(prefill, OWN_KERNEL)]
    decode = {r["label"]: at[(r["label"], OWN_KERNEL)] / at[(r["label"], "grouped")]
              for r in block if r["case"] == "decode"}  # fmt: skip
    return {
        "own_kernel_speedup_over_loop_prefill": {
            "case": prefill, "value": own, "target_at_least": TARGET_OWN_OVER_LOOP,
            "met": own >= TARGET_OWN_OVER_LOOP},
        "own_kernel_time_over_grouped_decode": {
            "values": decode, "target_at_most": TARGET_OWN_OVER_GROUPED_DECODE,
            "met": all(v <= TARGET_OWN_OVER_GROUPED_DECODE for v in decode.values())},
    }  # fmt: skip


def own_kernel_target_lines(t: dict[str, Any]) -> list[str]:
    """The console lines of own_kernel_targets' targets."""
    if "own_kernel_speedup_over_loop_prefill" not in t:
        return []
    s, d = t["own_kernel_speedup_over_loop_prefill"], t["own_kernel_time_over_grouped_decode"]
    values = ", ".join(f"{k} {v:.2f}x" for k, v in d["values"].items())
    return [f"target: own-kernel at least {s['target_at_least']}x faster than loop at "
            f"{s['case']}: {s['value']:.2f}x, {harness.met(s['met'])}",
            f"target: own-kernel's decode time at most {d['target_at_most']}x grouped's: "
            f"{values}: {harness.met(d['met'])}"]  # fmt: skip

"""The machine's limits, measured through MLX: matmul GFLOP/s (fp32, bf16, and fp16 when that
is the run's dtype), copy GB/s, and the GB/s of one large matrix-vector product (gemv).

A model's prefill is compared with the matmul ceiling, its decode with the bandwidth ceiling
(the larger of copy and gemv). `timed`, `sample` and `stats` time any MLX computation.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from benches.harness import log, plan_runs
from tiny_llm_support.cli import DTYPES


def timed(fn: Callable[[], Any]) -> float:
    """Seconds to build and evaluate fn()."""
    t0 = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t0


def take_turns(
    fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 0, after=lambda name: None
) -> dict[str, list[float]]:
    """Seconds of each fn (timed), the fns taking turns in plan_runs' order (forward, then
    reversed, ...: a machine that drifts favours none of them) for warmup + rounds rounds, the
    first `warmup` not kept; after(name) follows every call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r, _, name in plan_runs(list(fns), warmup + rounds):
        seconds = timed(fns[name])
        if r >= warmup:
            times[name].append(seconds)
        after(name)
    return times


def sample(fn: Callable[[], Any], repeats: int, budget_s: float) -> list[float]:
    """Times of `fn`: an untimed warm-up call, then up to `repeats` timed calls (at least 2,
    fewer once budget_s is spent). A warm-up call over 1.5 s counts as a sample itself: a
    kernel that slow gains nothing from warming up."""
    first = timed(fn)
    times = [first] if first > 1.5 else []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - start < budget_s):
        times.append(timed(fn))
    return times


def stats(values: Sequence[float]) -> dict[str, Any]:
    v = list(values)
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}


def copy_gbs(copy_mb: int, repeats: int, key: mx.array) -> dict[str, Any]:
    """Copy: a float32 source larger than the caches, copied in 8 MB pieces. A single large
    output would come from a fresh mmap every time on Linux, and the page faults of first
    touching it would be timed as well; that number is recorded separately."""
    piece = 2 * 1024 * 1024
    src = mx.random.uniform(-1, 1, (max(1, copy_mb * 1024 * 1024 // 4 // piece), piece), key=key)
    mx.eval(src)
    views = [src[i] for i in range(src.shape[0])]  # slices of a contiguous array: no copies

    def copy_all() -> float:
        t0 = time.perf_counter()
        for view in views:
            mx.eval(view + 0)  # reads 4 bytes and writes 4 bytes per element
        return time.perf_counter() - t0

    copy_all()
    nbytes, flat = 2 * src.nbytes, src.reshape(-1)
    copies = stats([nbytes / copy_all() / 1e9 for _ in range(max(2, repeats))])
    fresh = stats([nbytes / timed(lambda: flat + 0) / 1e9 for _ in range(2)])
    return {"copy_bytes": nbytes, "copy_gbs": copies, "copy_fresh_allocation_gbs": fresh}


def measure_ceilings(size: int, copy_mb: int, repeats: int, dtype: mx.Dtype) -> dict[str, Any]:
    out: dict[str, Any] = {"matmul_size": size}
    ka, kb = mx.random.split(mx.random.key(1))
    for name, dt in DTYPES.items():
        if name == "float16" and dt != dtype:
            continue
        a = mx.random.uniform(-1, 1, (size, size), key=ka).astype(dt)  # [size, size]
        b = mx.random.uniform(-1, 1, (size, size), key=kb).astype(dt)
        mx.eval(a, b)
        times = sample(lambda a=a, b=b: a @ b, repeats, budget_s=5.0)
        gflops = out[f"matmul_{name}_gflops"] = stats([2.0 * size**3 / t / 1e9 for t in times])
        log(f"  matmul {size}x{size} {name}: {gflops['max']:.1f} GFLOP/s (best of {len(times)})")
    out.update(copy_gbs(copy_mb, repeats, ka))
    # gemv: one row times a weight matrix far larger than the caches: the shape of decode
    shape = (16384, 4096)
    w = mx.random.uniform(-1, 1, shape, key=ka).astype(dtype)  # [16384, 4096]
    v = mx.random.uniform(-1, 1, (1, shape[1]), key=kb).astype(dtype)  # [1, 4096]
    mx.eval(w, v)
    times = sample(lambda: v @ w.T, max(3, repeats), budget_s=4.0)
    out["gemv_gbs"] = stats([w.nbytes / t / 1e9 for t in times])
    out["gemv_shape"] = list(shape)
    out["bandwidth_ceiling_gbs"] = max(out["copy_gbs"]["max"], out["gemv_gbs"]["max"])
    dname = next(name for name, dt in DTYPES.items() if dt == dtype)
    out["matmul_ceiling_gflops"] = out[f"matmul_{dname}_gflops"]["max"]
    out["ceiling_dtype"] = dname
    log(
        f"  copy {out['copy_gbs']['max']:.1f} GB/s (read+write, 8 MB pieces; "
        f"{out['copy_fresh_allocation_gbs']['max']:.1f} GB/s into one fresh "
        f"{out['copy_bytes'] // 2 >> 20} MB array), gemv {dname} {out['gemv_gbs']['max']:.1f} GB/s"
    )
    return out

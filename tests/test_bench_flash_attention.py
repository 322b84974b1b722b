"""Smoke test of benches/flash_attention.py (not a course day: check-course skips this file).

The reference solution, tiny sizes, the tiny synthetic checkpoint for the decode runs.
"""

import json

from helpers import load_bench

from tiny_llm_support import make_tiny_checkpoint

bench = load_bench("flash_attention")


def test_bench_writes_every_method_and_the_goals(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    out = tmp_path / "flash.json"
    args = ["--model", str(ckpt), "--num-layers", "2", "--lengths", "32", "64"]
    args += ["--block-sizes", "16", "--contexts", "20", "--batches", "1", "2"]
    args += ["--repeats", "2", "--warmup", "0", "--json-output", str(out), "--no-openblas"]
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    rows = {
        kind: [r for r in report["runs"] if r["kind"] == kind] for kind in ("attention", "decode")
    }
    attention = {(r["length"], r["method"]) for r in rows["attention"]}
    assert attention == {(n, m) for n in (32, 64) for m in ("dense", "flash-16", "mx.fast")}
    for r in rows["attention"]:
        assert r["max_abs_error_vs_mx_fast"] < 1e-4, r["method"]
        assert len(r["samples_ms"]) == 2 and r["peak_bytes"] > 0
    decode = {(r["batch"], r["method"]) for r in rows["decode"]}
    kinds = {"paged-gather", "paged-in-place", "dense", "mlx-lm"}
    assert decode == {(1, k) for k in kinds} | {
        (2, k) for k in kinds | {"paged-in-place-per-request"}
    }
    for r in rows["decode"]:
        assert r["max_abs_logit_diff_vs_gather"] < 1e-3, r["method"]  # the same step each way
        assert r["held_bytes"] > 0
    assert set(report["summary"]["flash_peak_over_dense"]) == {"flash-16"}
    assert set(report["summary"]["in_place_time_over_gather"]) == {"batch 1", "batch 2"}
    assert out.with_suffix(".png").exists()

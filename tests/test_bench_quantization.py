"""A smoke run of benches/quantization.py (not a course day: check-course skips this file).

The model is a random-weight one with the tiny checkpoint's shape (head_dim 64, so the INT8
cache's groups of 64 fit): every part runs in a few seconds, and what it reports is checked
for the relations that must hold whatever the machine.
"""

import json

from helpers import load_bench

from tiny_llm_support import make_tiny_checkpoint

quantization = load_bench("quantization")


def test_bench_quantization_smoke(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny", head_dim=64)
    output = tmp_path / "out.json"
    args = ["--model", str(model), "--device", "cpu", "--json-output", str(output)]
    args += ["--prefill-tokens", "8", "--decode-steps", "1", "--repeats", "1"]
    args += ["--contexts", "256", "--agreement-tokens", "4"]
    assert quantization.main(args) == 0
    report = json.loads(output.read_text())
    rows = {part: [r for r in report["runs"] if r["part"] == part] for part in ("weights", "kv")}
    weights = {(row["weights"], row["quantized_linear"]): row for row in rows["weights"]}
    assert len(weights) == 7  # float32, and 8-bit and 4-bit on each of the three paths
    held = lambda name, path: weights[(name, path)]["model_bytes"]
    assert held("4bit", "kernel") < held("8bit", "kernel") < held("float32", None)
    assert held("8bit", "dequantize-at-load") == held("float32", None)
    assert all(row["decode_ms_per_token"] > 0 for row in rows["weights"])
    kv = {row["kv_cache"]: row["kv_bytes_per_token"] for row in rows["kv"]}
    assert kv["int8"] <= 0.30 * kv["float32"]
    for summary in report["summary"]["agreement"].values():
        assert 0 <= summary["forced_agreement"] <= 1
        assert 0 <= summary["mean_matching_prefix"] <= 4

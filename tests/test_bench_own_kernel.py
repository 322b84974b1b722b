"""A smoke run of benches/own_kernel.py (not a course day): --quick (the Qwen3-0.6B shape with one
layer, four timed decode tokens, three timings of each kernel, one repeat), every run in a fresh
process. The report must hold every key the chapter reads, each a positive number; the plain loop
is timed on the 3072x1024 weight only, and the targets are computed from the ratios. No timing is
asserted."""

import json

from helpers import load_bench

bench = load_bench("own_kernel")

KERNEL_KEYS = {
    "packed_mb", "float32_mb", "fast_ms", "plain_ms", "mlx_quantized_matmul_ms",
    "float32_matmul_ms", "fast_gbs", "float32_gbs", "fast_vs_mlx", "fast_vs_float32",
}  # fmt: skip
DECODE_KEYS = {"tokens_per_s", "step_ms", "weights_mb", "gbs", "rss_mb"}
RATIOS = {"own_vs_float32", "own_vs_mlx_lm_4bit", "own_bandwidth_fraction",
          "own_weights_vs_float32"}  # fmt: skip


def test_bench_own_kernel_smoke(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--json-output", str(out)]) == 0
    assert "own_vs_float32 >= 2.5" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["benchmark"] == "own-kernel"
    assert report["settings"]["num_layers"] == 1 and report["settings"]["decode_tokens"] == 4
    assert len(report["settings"]["loadavg_at_start"]) == 3
    assert sorted(r["part"] for r in report["runs"]) == ["decode"] * 4 + ["kernel"]

    summary = report["summary"]
    assert summary["bandwidth_gbs"] > 0
    assert set(summary["kernel"]) == {"3072x1024", "1024x3072", "151936x1024"}
    for shape, row in summary["kernel"].items():
        assert set(row) == KERNEL_KEYS
        for key, value in row.items():
            if key == "plain_ms" and shape != "3072x1024":
                assert value is None, "the plain loop is timed on the small weight only"
            else:
                assert value > 0, (shape, key)
    head = summary["kernel"]["151936x1024"]
    assert head["float32_mb"] == 151936 * 1024 * 4 / 1e6
    assert head["packed_mb"] == 151936 * (1024 // 8 * 4 + 2 * 1024 // 64 * 4) / 1e6

    assert [r["rows"] for r in summary["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    for row in summary["rows"]:
        assert row["kernel_ms"] > 0 and row["dequantize_matmul_ms"] > 0

    decode = summary["decode"]
    assert set(decode) == {"float32", "own-kernel-4bit", "mlx-kernel-4bit", "mlx-lm-4bit"}
    for variant, row in decode.items():
        assert set(row) == DECODE_KEYS
        assert all(value > 0 for value in row.values()), variant
    assert decode["own-kernel-4bit"]["weights_mb"] < decode["float32"]["weights_mb"] / 4

    ratios = summary["ratios"]
    assert set(ratios) == RATIOS and all(v > 0 for v in ratios.values())
    assert set(report["targets"]) == set(bench.TARGETS)
    for key, target in report["targets"].items():
        assert target["target"] == bench.TARGETS[key] and target["value"] == ratios[key]
        assert target["met"] == (ratios[key] >= target["target"])

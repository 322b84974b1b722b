"""A smoke run of benches/few_row.py (not a course day): --quick (the Qwen3-0.6B shape with one
layer, four timed decode steps of 1 and 8 rows, three timings of each kernel, one repeat), every
run in a fresh process. The report must hold every key the chapter reads, each a positive number;
numpy's sgemv is timed at one row only, and the targets are computed from the ratios. No timing
is asserted."""

import json

from helpers import load_bench

bench = load_bench("few_row")

KERNEL_KEYS = {"few_row_gbs", "mlx_matmul_gbs", "few_row_4bit_gbs", "day1_4bit_gbs"}
DECODE_KEYS = {"variant", "rows", "step_ms", "tokens_per_s", "weights_mb", "floor_ms", "vs_floor"}


def test_bench_few_row_smoke(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--json-output", str(out)]) == 0
    assert "one_row_vs_sgemv >= 0.8" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["benchmark"] == "few-row"
    assert report["settings"]["num_layers"] == 1 and report["settings"]["decode_tokens"] == 4
    parts = sorted(r["part"] for r in report["runs"])
    assert parts == ["decode"] * 2 * len(bench.VARIANTS) + ["kernel"]

    summary = report["summary"]
    assert summary["bandwidth_gbs"] == max(summary["ceilings"].values()) > 0
    assert set(summary["kernel"]) == {"3072x1024", "1024x3072", "151936x1024"}
    for shape, rows in summary["kernel"].items():
        assert list(rows) == [str(m) for m in bench.ROWS]
        for m, row in rows.items():
            want = KERNEL_KEYS | ({"numpy_sgemv_gbs"} if m == "1" else set())
            assert set(row) == want, (shape, m)
            assert all(value > 0 for value in row.values()), (shape, m)

    decode = summary["decode"]
    assert set(decode) == {f"{v} x{b}" for v in bench.VARIANTS for b in (1, 8)}
    for key, row in decode.items():
        assert set(row) == DECODE_KEYS
        assert row["step_ms"] > 0 and row["floor_ms"] > 0, key
        assert row["vs_floor"] == row["step_ms"] / row["floor_ms"]
    assert decode["4bit-few-row x1"]["weights_mb"] < decode["float32-few-row x1"]["weights_mb"] / 4

    ratios = summary["ratios"]
    assert set(ratios) == {"one_row_vs_sgemv", "eight_rows_vs_mlx", "step_of_8_vs_floor"}
    for key, target in report["targets"].items():
        assert target["value"] == ratios[key]
        below = key == "step_of_8_vs_floor"
        assert target["met"] == (ratios[key] <= target["target"] if below else
                                 ratios[key] >= target["target"])  # fmt: skip

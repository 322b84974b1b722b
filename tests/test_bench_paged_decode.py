"""A smoke run of benches/paged_decode.py (not a course day): --quick (batch 2, 256 positions,
three timings of each variant). Every variant agrees with MLX's attention on a dense cache (the
bench raises otherwise); the report holds every key the chapter reads, each a positive number,
and the targets are computed from the ratios. No timing is asserted."""

import json

from helpers import load_bench

bench = load_bench("paged_decode")


def test_bench_paged_decode_smoke(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert bench.main(["--quick", "--json-output", str(out)]) == 0
    assert "own_vs_paged_attention >= 1.5" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["benchmark"] == "paged-decode"
    assert report["settings"]["batch"] == 2 and report["settings"]["contexts"] == [256]
    assert len(report["settings"]["loadavg_at_start"]) == 3
    row = report["summary"]["256"]
    for variant in bench.VARIANTS:
        assert row[variant]["ms"] > 0 and row[variant]["gbs"] > 0, variant
    assert row["kv_mb"] == 2 * 2 * bench.H_KV * 256 * bench.HEAD_DIM * 4 / 1e6
    assert row["own_vs_paged_attention"] > 0 and row["own_over_dense_sdpa"] > 0
    assert set(report["targets"]) == set(bench.TARGETS)
    for target in report["targets"].values():
        assert target["context"] == 256 and isinstance(target["met"], bool)

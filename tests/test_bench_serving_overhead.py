"""A smoke run of benches/serving_overhead.py (not a course day): the shipped tiny model, two
requests of two tokens, one run of each mode; the report must hold what both modes generated and
the relations that hold on any machine."""

import json

from helpers import load_bench

serving_overhead = load_bench("serving_overhead")


def test_bench_serving_overhead_smoke(tmp_path):
    out = tmp_path / "out.json"
    args = ["--prompts", "2", "--max-tokens", "2", "--repeats", "1", "--json-output", str(out)]
    assert serving_overhead.main(args) == 0
    report = json.loads(out.read_text())
    assert [run["mode"] for run in report["runs"]] == ["engine", "server"]
    for run in report["runs"]:
        assert run["tokens"] == 4, f"{run['mode']}: 2 requests x 2 tokens (ignore_eos)"
        assert run["ttft_ms"]["count"] == 2 and run["tokens_per_s"] > 0
    engine = report["runs"][0]
    assert 0 <= engine["collect_share"] < 1 and engine["iterate_ms"]["count"] >= 2
    assert report["summary"]["server_over_engine"] > 0

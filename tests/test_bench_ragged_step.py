"""A smoke run of benches/ragged_step.py (not a course day): the shipped tiny model, batches of 1
and 2, each mode in a fresh process; every mode must report its steps, their parts and a ratio
over dense."""

import json

from helpers import load_bench

load_bench("serving")
ragged_step = load_bench("ragged_step")


def test_bench_ragged_step_smoke(tmp_path):
    out = tmp_path / "out.json"
    args = ["--model", "tiny", "--batches", "1", "2", "--context", "12", "--steps", "2"]
    assert ragged_step.main([*args, "--json-output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2 * len(ragged_step.MODES), "one run per (mode, batch)"
    for run in report["runs"]:
        assert run["step_ms"]["count"] == 2 and run["step_ms"]["median"] > 0
        assert run["peak_bytes"] > 0
        parts = run["mean_parts_ms"]
        assert set(parts) == {"graph", "compute", "host", "linear", "kv"}, parts
        assert parts["graph"] > 0 and parts["compute"] > 0 and parts["linear"] > 0, (
            f"{run['mode']}: the forward call or the token read was never timed: {parts}"
        )
    row = report["summary"]["2"]
    assert row["over_dense"]["dense"] == 1.0
    assert set(row["median_step_ms"]) == set(ragged_step.MODES)
    assert report["targets"]["batch"] == 2

"""A smoke run of benches/structured_output.py (not a course day): the shipped tiny chat model,
batches of 1 and 2, two timed steps, one walk of each kind, every run in a fresh process. The
report must hold every row, and what holds on any machine: a constrained row's text is the
schema's (it opens an array), only runs with a grammar spend time building masks, and the
target is computed at the largest batch. No timing is asserted."""

import json

import pytest
from helpers import load_bench

load_bench("serving_load")
bench = load_bench("structured_output")


def test_bench_structured_output_smoke(tmp_path, capsys):
    out = tmp_path / "out.json"
    args = ["--models", "tiny", "--batches", "1", "2", "--steps", "2", "--walks", "1"]
    assert bench.main([*args, "--json-output", str(out)]) == 0
    assert "target: every row constrained at batch 2 within 1.1x of none" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["benchmark"] == "structured-output"

    masks = [r for r in report["runs"] if r["part"] == "mask"]
    assert {"tiny", "tiny-padded"} <= {r["label"] for r in masks}
    for run in masks:
        assert run["tokens"] > 10 and run["row_us"]["count"] == run["tokens"]
        assert run["matcher_us"]["count"] == run["tokens"] and run["row_us"]["median"] > 0
    mask = report["summary"]["mask"]
    assert mask["tiny"]["vocab"] == 2048 and mask["tiny-padded"]["vocab"] == 151936
    assert mask["big"]["available"] == ("big" in {r["label"] for r in masks})

    decode = [r for r in report["runs"] if r["part"] == "decode"]
    assert sorted((r["batch"], r["how"]) for r in decode) == [
        (1, "all"), (1, "none"), (2, "all"), (2, "none"), (2, "one"),
    ]  # fmt: skip
    for run in decode:
        assert run["step_ms"]["count"] == 2 and run["tokens_per_s"] > 0
        if run["constrained"]:
            assert run["first_row_text"].startswith("["), "the schema's array, from token one"
            assert run["constrain_ms_per_step"] > 0, "the masks were never built"
        else:
            assert run["constrain_ms_per_step"] == 0, "a batch without a grammar builds no mask"
    rows = report["summary"]["decode"]["tiny"]["2"]
    assert set(rows) == {"none", "one", "all", "one_over_none", "all_over_none"}
    targets = report["targets"]
    assert targets["batch"] == 2 and targets["ratios"]["tiny"] == rows["all_over_none"]
    assert targets["met"] == (rows["all_over_none"] <= bench.TARGET_RATIO)


def test_a_model_that_is_no_shape_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--models", "tiny", "no-such-model", "--json-output", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "--models no-such-model" in capsys.readouterr().err

"""Smoke tests of the benchmarks in benches/ (not a course day: check-course skips this file).

They use the reference solution and the tiny synthetic checkpoint, and take a few seconds.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
BENCHES = ROOT / "benches"
sys.path.insert(0, str(BENCHES))

import chunked_prefill as cp  # noqa: E402
import common  # noqa: E402

# seed 0, 3 requests, prompt lengths 5..40, budgets 2..4, ids from the tiny vocabulary
# (661 ids, 656..660 special). Changing how traces are drawn must change this on purpose.
TINY_TRACE_ARGS = dict(
    seed=0,
    num_seqs=3,
    input_len=(5, 40),
    output_len=(2, 4),
    token_ids=(0, 661),
    excluded_ids=[656, 657, 658, 659, 660],
)
TINY_TRACE_SHA256 = "8eb39b581c8418270f5445a09da2f34d12a9df105e40fe2162c3bcc074f14551"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench-tiny"), seed=0)


def test_trace_is_deterministic_and_in_range():
    trace = cp.make_trace(**TINY_TRACE_ARGS)
    assert trace.sha256() == TINY_TRACE_SHA256
    assert cp.make_trace(**TINY_TRACE_ARGS).to_dict() == trace.to_dict()
    assert cp.make_trace(**{**TINY_TRACE_ARGS, "seed": 1}).sha256() != trace.sha256()
    assert len(trace.prompts) == 3
    assert all(5 <= len(p) <= 40 for p in trace.prompts)
    assert all(2 <= b <= 4 for b in trace.output_budgets)
    ids = {t for p in trace.prompts for t in p}
    assert ids <= set(range(656)), "prompt ids must avoid special tokens and stay in the vocab"
    # excluded ids in the middle of the range are skipped, not just clipped
    dense = cp.make_trace(1, 1, (400, 400), (1, 1), (0, 6), [2, 3])
    assert set(dense.prompts[0]) == {0, 1, 4, 5}


def test_percentile_matches_linear_interpolation():
    assert common.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert common.percentile([10.0], 95) == 10.0
    assert common.percentile([0.0, 100.0], 95) == pytest.approx(95.0)
    assert common.percentile([], 50) is None


def test_run_trace_generates_exactly_the_budgets(tiny_dir):
    import tiny_llm_ref

    model = tiny_llm_ref.Qwen3Model(load_checkpoint(tiny_dir))
    trace = cp.make_trace(**TINY_TRACE_ARGS)
    for budget in (8, 64):
        result = cp.run_trace(model, tiny_llm_ref, trace, budget, batch_size=2)
        m, raw = result["metrics"], result["raw"]
        assert m["output_tokens"] == sum(trace.output_budgets)
        # each request's first token comes from its last prefill chunk, the rest from decode
        assert m["decode_tokens"] == sum(trace.output_budgets) - len(trace.prompts)
        assert m["prefill_chunks"] == sum(-(-len(p) // budget) for p in trace.prompts)
        assert len(raw["decode_step_s"]) == m["decode_steps"] > 0
        assert len(raw["decode_gap_s"]) == m["decode_gaps"] <= m["decode_steps"] - 1
        assert all(t is not None and t > 0 for t in raw["ttft_s"] + raw["finish_s"])
        assert all(f >= t for t, f in zip(raw["ttft_s"], raw["finish_s"]))
        assert m["decode_gap_ms_p95"] >= m["decode_gap_ms_median"] > 0


def test_cli_writes_the_report(tiny_dir, tmp_path):
    out = tmp_path / "report.json"
    args = [
        "--model",
        str(tiny_dir),
        "--prefill-steps",
        "8",
        "64",
        "--num-seqs",
        "3",
        "--batch-size",
        "2",
        "--min-input-len",
        "5",
        "--max-input-len",
        "40",
        "--min-output-len",
        "2",
        "--max-output-len",
        "4",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--no-plot",
        "--json-output",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, str(BENCHES / "chunked_prefill.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[2/2] prefill step" in proc.stderr  # one progress line per run
    report = json.loads(out.read_text())
    for key in (
        "host",
        "mlx",
        "device",
        "dtype",
        "blas",
        "model",
        "arguments",
        "trace",
        "runs",
        "budgets",
    ):
        assert key in report, key
    trace = report["trace"]
    assert trace["sha256"] == cp.make_trace(**TINY_TRACE_ARGS).sha256() == TINY_TRACE_SHA256
    assert trace["output_budgets"] == cp.make_trace(**TINY_TRACE_ARGS).output_budgets
    assert report["dtype"] == "float32" and report["model"]["num_layers"] == 2
    assert [r["prefill_step"] for r in report["runs"]] == [8, 64]
    assert len({r["pid"] for r in report["runs"]}) == 2  # a fresh process per run
    assert [row["prefill_step"] for row in report["budgets"]] == [8, 64]
    for row in report["budgets"]:
        assert row["runs"] == 1
        assert set(cp.SCALAR_METRICS) <= set(row["median"])
        assert row["median"]["output_tokens_per_s"] > 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--min-input-len", "9", "--max-input-len", "8"], "--min-input-len 9 > --max-input-len 8"),
        (["--min-output-len", "5", "--max-output-len", "4"], "--min-output-len"),
        (["--prefill-steps"], "expected at least one argument"),
        (["--prefill-steps", "0"], "integer >= 1"),
        (["--prefill-steps", "16", "16"], "more than once"),
        (["--batch-size", "-1"], "integer >= 1"),
        (["--model", "no-such-model"], "unknown model"),
    ],
)
def test_bad_arguments_fail_before_any_run(bad, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cp.main([*bad, "--json-output", "/nonexistent/never-written.json"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

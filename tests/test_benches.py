"""Smoke tests of the benchmarks in benches/ (not a course day: check-course skips this file).

They use the reference solution and the tiny synthetic checkpoint, and take a few seconds.
"""

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import BENCHES, load_bench

import tiny_llm_ref
from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = BENCHES / "results" / "chunked-prefill-qwen3-0.6b-12layers-linux-x86_64-2cpu.json"
TASK = re.compile(r"Week \d+ Day \d+, Task \d+: ")


harness = load_bench("harness")
tr = load_bench("trace_run")
cp = load_bench("chunked_prefill")
load_bench("ceilings")
impls = load_bench("model_impls")
bench_model = load_bench("model")

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
    trace = tr.make_trace(**TINY_TRACE_ARGS)
    assert trace.sha256() == TINY_TRACE_SHA256
    assert tr.make_trace(**TINY_TRACE_ARGS).to_dict() == trace.to_dict()
    assert tr.make_trace(**{**TINY_TRACE_ARGS, "seed": 1}).sha256() != trace.sha256()
    assert len(trace.prompts) == 3
    assert all(5 <= len(p) <= 40 for p in trace.prompts)
    assert all(2 <= b <= 4 for b in trace.output_budgets)
    ids = {t for p in trace.prompts for t in p}
    assert ids <= set(range(656)), "prompt ids must avoid special tokens and stay in the vocab"
    # excluded ids in the middle of the range are skipped, not just clipped
    dense = tr.make_trace(1, 1, (400, 400), (1, 1), (0, 6), [2, 3])
    assert set(dense.prompts[0]) == {0, 1, 4, 5}


def test_percentile_matches_linear_interpolation():
    assert harness.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert harness.percentile([10.0], 95) == 10.0
    assert harness.percentile([0.0, 100.0], 95) == pytest.approx(95.0)
    assert harness.percentile([], 50) is None


def test_serve_generates_exactly_the_budgets(tiny_dir):
    """The solution's own batch_generate serves the trace; the bench only watches on_step."""
    model = tiny_llm_ref.Qwen3Model(load_checkpoint(tiny_dir))
    trace = tr.make_trace(**TINY_TRACE_ARGS)
    for budget in (8, 64):
        options = {"batch_size": 2, "prefill_step": budget}
        result = tr.serve(tiny_llm_ref, model, trace, options)
        m, raw = result["metrics"], result["raw"]
        assert m["output_tokens"] == sum(trace.output_budgets)
        # each request's first token comes from its last prefill chunk, the rest from decode
        assert m["decode_tokens"] == sum(trace.output_budgets) - len(trace.prompts)
        assert m["prefill_chunks"] == sum(-(-len(p) // budget) for p in trace.prompts)
        assert len(raw["prefill_chunk_s"]) == m["prefill_chunks"]
        assert len(raw["decode_step_s"]) == m["decode_steps"] > 0
        assert len(raw["decode_gap_s"]) == m["decode_gaps"] <= m["decode_steps"] - 1
        assert all(t is not None and t > 0 for t in raw["ttft_s"] + raw["finish_s"])
        assert all(f >= t for t, f in zip(raw["ttft_s"], raw["finish_s"]))
        assert m["decode_gap_ms_p95"] >= m["decode_gap_ms_median"] > 0
        assert m["wall_s"] >= max(raw["finish_s"])


def test_serve_refuses_a_solution_that_ignores_the_budgets(tiny_dir):
    model = tiny_llm_ref.Qwen3Model(load_checkpoint(tiny_dir))
    trace = tr.make_trace(**TINY_TRACE_ARGS)

    def one_token_more(*args, max_new_tokens, **kwargs):
        more = [b + 1 for b in max_new_tokens]
        return tiny_llm_ref.batch_generate(*args, max_new_tokens=more, **kwargs)

    api = types.SimpleNamespace(batch_generate=one_token_more)
    with pytest.raises(tr.WrongOutput, match="max_new_tokens"):
        tr.serve(api, model, trace, {"batch_size": 2, "prefill_step": 8})


def test_committed_result_names_its_trace():
    """The committed measurement's trace is what make_trace draws from its stored arguments,
    so a rerun with the same arguments serves the same requests."""
    report = json.loads(COMMITTED.read_text())
    args, recorded = report["settings"]["arguments"], report["settings"]["trace"]
    model = harness.resolve_bench_model(args["model"], args["random_weights"], args["num_layers"])
    trace = tr.make_trace(
        args["seed"],
        args["num_seqs"],
        (args["min_input_len"], args["max_input_len"]),
        (args["min_output_len"], args["max_output_len"]),
        model.token_ids,
        model.excluded_ids,
    )
    assert trace.sha256() == recorded["sha256"]
    assert trace.prompts == recorded["prompts"]
    assert trace.output_budgets == recorded["output_budgets"]


def assert_schema_of_committed_result(report: dict) -> None:
    """The report has every field the committed measurement has, down to one run's metrics
    and raw times, and the per-budget rows."""
    committed = json.loads(COMMITTED.read_text())
    assert set(committed) <= set(report), set(committed) - set(report)
    assert report["benchmark"] == committed["benchmark"]
    for part in ("host", "settings", "summary"):
        assert set(committed[part]) <= set(report[part]), part
    for part, inner in (("settings", "trace"), ("settings", "model"), ("host", "blas")):
        assert set(committed[part][inner]) <= set(report[part][inner]), inner
    run, old_run = report["runs"][0], committed["runs"][0]
    assert set(old_run) <= set(run), set(old_run) - set(run)
    assert set(old_run["metrics"]) <= set(run["metrics"]), "the committed metrics stay"
    assert set(run["raw"]) == set(old_run["raw"])
    row, old_row = report["summary"]["budgets"][0], committed["summary"]["budgets"][0]
    assert set(old_row) <= set(row), set(old_row) - set(row)
    assert set(old_row["median"]) <= set(row["median"])


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
        [sys.executable, "-m", "benches", "chunked-prefill", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[2/2] alternate prefill step" in proc.stderr  # one progress line per run
    report = json.loads(out.read_text())
    assert_schema_of_committed_result(report)
    settings, budgets = report["settings"], report["summary"]["budgets"]
    trace = settings["trace"]
    assert trace["sha256"] == tr.make_trace(**TINY_TRACE_ARGS).sha256() == TINY_TRACE_SHA256
    assert trace["output_budgets"] == tr.make_trace(**TINY_TRACE_ARGS).output_budgets
    assert settings["dtype"] == "float32" and settings["model"]["num_layers"] == 2
    assert [r["prefill_step"] for r in report["runs"]] == [8, 64]
    assert len({r["pid"] for r in report["runs"]}) == 2  # a fresh process per run
    assert [row["prefill_step"] for row in budgets] == [8, 64]
    for row in budgets:
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


def test_unfinished_solution_stops_with_the_task(tiny_dir, tmp_path):
    """--solution tiny_llm on the skeleton: the run names the first missing task in one line,
    and neither process shows a traceback. (A finished tiny_llm must run like the reference.)"""
    out = tmp_path / "report.json"
    args = ["--model", str(tiny_dir), "--solution", "tiny_llm", "--prefill-steps", "8"]
    args += ["--num-seqs", "2", "--min-input-len", "5", "--max-input-len", "20"]
    args += ["--max-output-len", "2", "--min-output-len", "2", "--repeats", "1", "--no-plot"]
    proc = subprocess.run(
        [sys.executable, "-m", "benches", "chunked-prefill", *args, "--json-output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode == 0:
        assert json.loads(out.read_text())["settings"]["solution"] == "tiny_llm"
        return
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    [line] = [x for x in proc.stderr.splitlines() if TASK.search(x)]
    assert line.startswith("error: tiny_llm is not finished yet: Week ")
    assert not out.exists()


def test_bench_model_swaps_parts_without_touching_the_package(tiny_dir):
    """The ablation's fast parts are passed in: each layer uses them, the logits stay within
    rounding of the plain model, and the package's own attention function is unchanged."""
    ckpt = load_checkpoint(tiny_dir)
    grouped = tiny_llm_ref.qwen3.scaled_dot_product_attention_grouped
    calls = []

    def spy(q, k, v, mask=None):
        calls.append(q.shape)
        return impls.fast_attention(q, k, v, mask=mask)

    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    plain = impls.RefImpl(tiny_llm_ref, ckpt, "dense").prefill(tokens)[0]
    parts = {**impls.VARIANTS["+all-fast"], "attention": spy}
    fast = impls.RefImpl(tiny_llm_ref, ckpt, "dense", **parts)
    logits = fast.prefill(tokens)[0]
    assert len(calls) == ckpt.config.num_hidden_layers
    assert mx.allclose(logits, plain, atol=1e-4).item()
    assert isinstance(fast.model.norm, impls.FastRMSNorm)
    assert tiny_llm_ref.qwen3.scaled_dot_product_attention_grouped is grouped


def test_bench_model_swapped_attention_serves_a_ragged_pass(tiny_dir):
    """The hybrid policy's ragged pass attends through each layer's `attend`: the swapped core
    must run there too (not the package's own), with the same logits as the plain model."""
    ckpt = load_checkpoint(tiny_dir)
    calls = []

    def spy(q, k, v, mask=None):
        calls.append(q.shape)
        return impls.fast_attention(q, k, v, mask=mask)

    kv = impls.random_context(ckpt.config, 2, 8, mx.float32, seed=0)  # 2 rows, 8 positions
    steps = {}
    for name, parts in (("plain", {}), ("swapped", {"attention": spy})):
        impl = impls.RefImpl(tiny_llm_ref, ckpt, "ragged", **parts)
        cache, offset = impl.decode_cache(kv)
        calls.clear()
        steps[name] = impl.decode_step(mx.array([[5], [3]]), cache, offset)[0]
    layers = ckpt.config.num_hidden_layers
    assert len(calls) == 2 * layers, (
        f"the swapped attention ran {len(calls)} times in a ragged step of 2 rows over {layers} "
        "layers: forward_ragged calls self_attn.attend, which the swap must replace"
    )
    assert mx.allclose(steps["swapped"], steps["plain"], atol=1e-4).item()


def test_bench_model_refuses_the_ablation_on_ragged_passes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_model.main(["--model", "tiny", "--ablate", "--batch-cache", "ragged"])
    assert exit_info.value.code == 2
    assert "mx.fast.rope" in capsys.readouterr().err


def test_bench_model_cli_writes_its_report(tiny_dir, tmp_path):
    out = tmp_path / "model.json"
    args = ["--model", str(tiny_dir), "--prefill-lens", "16", "--decode-contexts", "16"]
    args += ["--decode-batches", "2", "--repeats", "1", "--decode-steps", "1"]
    args += ["--decode-warmup", "0", "--matmul-size", "64", "--copy-mb", "1"]
    args += ["--batch-cache", "batching", "--no-openblas", "--json-output", str(out)]
    assert bench_model.main(args) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["solution"] == "tiny_llm_ref"
    assert [row["kind"] for row in report["runs"]] == ["prefill", "decode"]
    assert report["summary"]["agreement"]["ref"]["same_argmax"]
    assert report["summary"]["ceilings"]["matmul_ceiling_gflops"] > 0


def test_policies_pools_and_mlx_lm_runs(tiny_dir, tmp_path):
    """Both policies and mlx-lm's server, then paged pools sized from the trace's peak: every
    run serves exactly the budgets (serve refuses otherwise) and the report keeps one row per
    setting, the alternate policy's first."""
    base = [sys.executable, "-m", "benches", "chunked-prefill", "--model", str(tiny_dir)]
    base += ["--prefill-steps", "8", "--num-seqs", "4", "--min-input-len", "8"]
    base += ["--max-input-len", "24", "--min-output-len", "4", "--max-output-len", "6"]
    base += ["--repeats", "1", "--warmup", "0", "--no-plot"]
    out = tmp_path / "policies.json"
    cmd = base + ["--policy", "alternate", "hybrid", "mlx-lm", "--json-output", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, cwd=BENCHES.parent)
    rows = json.loads(out.read_text())["summary"]["budgets"]
    assert [r["policy"] for r in rows] == ["alternate", "hybrid", "mlx-lm"]
    out = tmp_path / "pools.json"
    cmd = base + ["--policy", "hybrid", "--page-size", "4", "--pool-fractions", "1", "0.5"]
    subprocess.run(cmd + ["--json-output", str(out)], check=True, capture_output=True, timeout=300)
    summary = json.loads(out.read_text())["summary"]
    peak = summary["peak_pages_unbounded"]
    assert [r["max_pages"] for r in summary["budgets"]] == [peak, -(-peak // 2)]
    for row in summary["budgets"]:
        assert row["median"]["peak_pages"] <= row["max_pages"]


def test_shape_stable_bench(tiny_dir, tmp_path):
    """bench-shape-stable on the tiny checkpoint: the 3-step ladder compiles at most three
    prefill widths, nothing on the second pass, and generates the eager model's tokens."""
    out = tmp_path / "shape.json"
    cmd = [sys.executable, "-m", "benches", "shape-stable", "--model", str(tiny_dir)]
    cmd += ["--chunk-width", "32", "--new-tokens", "2", "--no-speeds", "--json-output", str(out)]
    cmd += ["--configs", "eager", "3 steps, cap 4", "no padding, cap 4"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, cwd=BENCHES.parent)
    configs = json.loads(out.read_text())["summary"]["configs"]
    three = configs["3 steps, cap 4"]
    assert len(three["prefill_widths"]) <= 3 and three["second_pass_compiles"] == 0
    assert three["tokens_equal_eager"] and configs["no padding, cap 4"]["tokens_equal_eager"]
    assert configs["no padding, cap 4"]["second_pass_compiles"] > 0

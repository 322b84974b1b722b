"""A smoke run of benches/prefix_cache.py (not a course day): a synthetic tiny checkpoint, a
small trace made for its vocabulary, one run of each mode. The report must hold what every
mode generated and the relations that hold on any machine: cache on generates the same ids
(and text) as cache off and prefills fewer prompt tokens. No timing is asserted."""

import hashlib
import json

import pytest
from helpers import load_bench

from tiny_llm_support import make_tiny_checkpoint

load_bench("trace_run")
bench = load_bench("prefix_cache")

CONVERSATIONS, TURNS, MAX_TOKENS = 2, 3, 4


def test_committed_trace_is_the_one_the_bench_expects():
    trace, other, sha = bench.read_trace(bench.DEFAULT_TRACE)
    assert sha == bench.DEFAULT_TRACE_SHA256, "update DEFAULT_TRACE_SHA256 with the trace file"
    assert len(trace.system) == 1024 and trace.max_tokens == 16
    assert [len(turns) for turns in trace.conversations] == [4] * 8
    assert all(32 <= len(u) <= 64 for turns in trace.conversations for u in turns)
    assert other["generator"]["seed"] == 0


def test_a_changed_committed_trace_is_refused(tmp_path, monkeypatch, capsys):
    changed = tmp_path / "prefix-agent.json"
    changed.write_text(
        bench.DEFAULT_TRACE.read_text().replace('"max_tokens": 16', '"max_tokens": 8')
    )
    monkeypatch.setattr(bench, "DEFAULT_TRACE", changed)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--trace", str(changed), "--no-openblas"])
    assert exit_info.value.code == 2
    assert "the trace file changed" in capsys.readouterr().err


def test_bench_prefix_cache_smoke(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    trace_path = tmp_path / "trace.json"
    shape = ["--system-tokens", "40", "--conversations", str(CONVERSATIONS)]
    shape += ["--turns", str(TURNS), "--max-tokens", str(MAX_TOKENS)]
    model = ["--model", str(ckpt), "--no-openblas"]
    args = [*model, *shape, "--user-tokens", "5", "9", "--write-trace", str(trace_path)]
    assert bench.main(args) == 0
    out = tmp_path / "out.json"
    args = [*model, "--trace", str(trace_path), "--page-size", "4", "--prefill-step", "16"]
    args += ["--batch-size", "2", "--json-output", str(out)]
    assert bench.main(args) == 0

    report = json.loads(out.read_text())
    assert report["benchmark"] == "prefix-cache"
    trace = report["settings"]["trace"]
    assert trace["file_sha256"] == hashlib.sha256(trace_path.read_bytes()).hexdigest()
    assert trace["used"]["conversations"] == CONVERSATIONS
    assert [run["mode"] for run in report["runs"]] == ["off", "on", "mlx-lm"]
    for run in report["runs"]:
        requests = run["requests"]
        assert len(requests) == CONVERSATIONS * TURNS, run["mode"]
        for r in requests:
            assert len(r["token_ids"]) == MAX_TOKENS, f"{run['mode']}: EOS is ignored"
            assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"]
            assert r["prefill_tokens"] + r["cached_tokens"] == r["prompt_tokens"]
        m = run["metrics"]
        assert m["prefill_tokens"] + m["cached_tokens"] == m["prompt_tokens"]
        assert m["generated_tokens"] == CONVERSATIONS * TURNS * MAX_TOKENS
        assert len(m["by_turn"]["ttft_ms_p50"]) == TURNS and m["ttft_later_ms_p50"] is not None

    off, on, mlx_lm = report["runs"]
    assert off["metrics"]["cached_tokens"] == 0
    assert off["metrics"]["prefill_tokens"] == off["metrics"]["prompt_tokens"]
    assert on["agreement_with_off"]["same_token_ids"], on["agreement_with_off"]
    assert on["agreement_with_off"]["same_text"]
    assert on["metrics"]["prompt_tokens"] == off["metrics"]["prompt_tokens"]
    assert on["metrics"]["prefill_tokens"] < off["metrics"]["prefill_tokens"]
    for run in (on, mlx_lm):  # a later turn finds its conversation so far in the cache
        assert all(r["cached_tokens"] > 0 for r in run["requests"] if r["turn"] > 1), run["mode"]
    assert on["metrics"]["peak_pages"] > 0 and mlx_lm["metrics"]["peak_pages"] is None

    modes = report["summary"]
    assert set(modes) == {"off", "on", "mlx-lm"}
    assert modes["on"]["same_token_ids_as_off"] is True
    targets = report["targets"]
    assert targets["generated_ids_on_equal_off"]["met"] is True
    for name in ("prefill_tokens_on_over_off", "ttft_later_turns_p50_off_over_on"):
        assert isinstance(targets[name]["met"], bool)
    assert targets["prefill_tokens_on_over_off"]["value"] < 1
    assert out.with_suffix(".png").exists()

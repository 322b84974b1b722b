"""A smoke run of benches/long_context.py (not a course day): the shipped tiny model, one short
prompt, a window of 16 positions, both parts. The report must hold every run and the relations
that hold on any machine: the windowed run gives pages back and holds fewer at its peak than the
full one, its logits equal those of explicit banded masks, the ring's logits equal one process's,
each of two ranks holds its own half of the prompt, and a disagreement stops the benchmark. No
timing is asserted. The two-rank run (mlx.launch) adds about five seconds."""

import json

import mlx.core as mx
import pytest
from helpers import REQUIRE_RANKS, load_bench

bench = load_bench("long_context")

PROMPT, WINDOW, CHUNK, PAGE, STEPS = 96, 16, 32, 8, 2
TWO_RANKS = mx.distributed.is_available("ring") or REQUIRE_RANKS
RANKS = [1, 2] if TWO_RANKS else [1]
TINY = ["--model", "tiny", "--prompt-lens", str(PROMPT), "--window", str(WINDOW)]
TINY += ["--chunk", str(CHUNK), "--page-size", str(PAGE), "--decode-steps", str(STEPS)]
TINY += ["--no-openblas"]


def test_bench_long_context_smoke(tmp_path, capsys):
    out = tmp_path / "long-context.json"
    assert bench.main([*TINY, "--ranks", *map(str, RANKS), "--json-output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "sliding window" in table and "ring prefill" in table

    report = json.loads(out.read_text())
    assert report["benchmark"] == "long-context"
    assert report["settings"]["window"] == WINDOW and report["settings"]["read_in_place"]
    window_rows = [r for r in report["runs"] if r["part"] == "window"]
    rows = {r["variant"]: r for r in window_rows}
    assert [r["variant"] for r in window_rows] == ["full", "window", "banded-mask"]
    full, window = rows["full"], rows["window"]
    for r in (full, window):
        assert len(r["chunk_s"]) == PROMPT // CHUNK and len(r["decode_step_s"]) == STEPS
        assert r["kv_peak_bytes"] == r["peak_pages"] * r["page_bytes"]
    layers = report["settings"]["model"]["num_layers"]
    assert full["pages_released"] == 0
    assert full["peak_pages"] == layers * -(-(PROMPT + STEPS + 1) // PAGE)  # every token kept
    # a windowed layer keeps at most its window, one chunk and a page on either side
    assert 0 < window["peak_pages"] <= layers * ((WINDOW + CHUNK) // PAGE + 2)
    assert window["pages_released"] > 0 and window["kv_peak_bytes"] < full["kv_peak_bytes"]

    checks = report["summary"]["agreement"]["checks"]
    assert report["summary"]["agreement"]["ok"] and all(c["relative_diff"] <= 1e-3 for c in checks)
    whats = {c["what"] for c in checks}
    assert {w for w in whats if w.startswith("window vs")} == {
        "window vs explicit banded masks, prefill logits",
        "window vs explicit banded masks, decode logits",
    }

    ring = {r["ranks"]: r for r in report["runs"] if r["part"] == "ring"}
    assert set(ring) == set(RANKS) and not any(r["skipped"] for r in ring.values())
    assert ring[1]["by_rank"][0]["tokens_held"] == PROMPT
    assert ring[1]["arithmetic"]["steps"] == 0 and ring[1]["ring_step_s"] is None
    if TWO_RANKS:
        two = ring[2]
        assert [r["tokens_held"] for r in two["by_rank"]] == [PROMPT // 2] * 2
        assert two["kv_bytes_by_rank"] == [ring[1]["kv_bytes_by_rank"][0] // 2] * 2
        a = two["arithmetic"]
        assert (
            a["steps"] == 1 and a["bytes_sent_per_rank_per_layer"] == a["bytes_per_step_per_layer"]
        )
        flops = a["attention_flops_per_layer_by_rank"]
        assert flops[1] == 2 * flops[0]  # rank 1: its own square and rank 0's block
        assert two["ring_step_s"] > 0
        assert "ring prefill, 2 ranks vs 1 rank" in whats
        assert "ring prefill, 2 ranks vs the full chunked prefill in one process" in whats


def test_a_disagreement_stops_the_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "AGREEMENT_RTOL", -1.0)  # any difference, even none, is too much
    out = tmp_path / "long-context.json"
    assert bench.main([*TINY, "--parts", "window", "--json-output", str(out)]) == 1
    assert "window vs explicit banded masks" in capsys.readouterr().err
    assert not out.exists()


def test_a_prompt_past_the_model_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*TINY, "--prompt-lens", "4096"])
    assert exit_info.value.code == 2
    assert "exceed 2048" in capsys.readouterr().err

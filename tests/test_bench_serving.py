"""A smoke run of benches/serving.py (not a course day): the trained tiny model, cast to
float32, served by tiny-llm's serve and by mlx_lm.server, three chat requests at one rate, then
a soak of four requests against serve with one client hanging up. Checked: the report's shape,
that every request completed, that greedy text agrees between the servers, and that the
hang-up was recorded as cancelled with every page back. No timing is asserted."""

import hashlib
import json

import tokenizers
from helpers import load_bench

from tiny_llm_support.tiny_tokenizer import tiny_tokenizer_json

bench = load_bench("serving")


def test_committed_traces_read_and_count_one_token_per_word():
    chat = bench.read_trace("chat", bench.TRACES["chat"], None)
    data = json.loads(bench.TRACES["chat"].read_text())
    assert chat.sha256 == hashlib.sha256(bench.TRACES["chat"].read_bytes()).hexdigest()
    assert len(chat.jobs) == data["generator"]["requests"] == 64
    tok = tokenizers.Tokenizer.from_str(tiny_tokenizer_json())
    for item in data["requests"][:8]:
        assert 64 <= item["prompt_words"] <= 512 and 32 <= item["max_tokens"] <= 128
        assert len(tok.encode(item["prompt"]).ids) == item["prompt_words"]
    agent = bench.read_trace("agent", bench.TRACES["agent"], 6)
    assert [(j.conversation, j.turn) for j in agent.jobs] == [
        (c, t) for t in (0, 1, 2) for c in (0, 1)
    ]
    assert len(agent.system.split()) == 1024


def test_bench_serving_smoke(tmp_path):
    out = tmp_path / "serving.json"
    args = ["--model", "tiny", "--servers", "tiny-llm", "mlx-lm", "--traces", "chat"]
    args += ["--requests", "3", "--rates", "2", "--soak", "4", "--batch-size", "4"]
    args += ["--json-output", str(out), "--note", "test"]
    assert bench.main(args) == 0
    assert out.with_suffix(".png").is_file()

    report = json.loads(out.read_text())
    assert report["benchmark"] == "serving"
    assert (
        report["settings"]["trace_files"][0]["file_sha256"]
        == hashlib.sha256(bench.TRACES["chat"].read_bytes()).hexdigest()
    )
    assert [(r["server"], r["trace"], r["rate"]) for r in report["runs"]] == [
        ("tiny-llm", "chat", 2.0),
        ("mlx-lm", "chat", 2.0),
    ]
    for run in report["runs"]:
        m = run["metrics"]
        assert (m["requests"], m["completed"], m["failed"]) == (3, 3, 0), m["errors"]
        assert m["output_tokens"] > 0 and m["output_tokens_per_s"] > 0
        for key in ("ttft", "inter_token_gap", "e2e"):
            assert set(m[key]) == {"p50_ms", "p95_ms", "p99_ms"}
        assert m["rss_before_bytes"] > 0 and m["rss_after_bytes"] > 0
        for q in run["requests"]:
            assert q["ttft_s"] > 0 and q["e2e_s"] >= q["ttft_s"] and q["output_tokens"] > 0
    # greedy: the same tokens, so the same text, but for the leading space mlx-lm trims
    match = report["summary"]["text_match"]["mlx-lm"]
    assert match["compared"] == 3
    assert match["identical"] + match["identical_but_leading_space"] == 3
    assert "vs mlx-lm" in next(iter(report["targets"]))

    soak = report["summary"]["soak"]
    assert soak["requests"] == 4 and soak["hangups_planned"] == 1
    assert (soak["completed"], soak["cancelled_by_client"]) == (3, 1)
    assert soak["server_finished"] + soak["server_aborted"] == 4
    assert soak["no_request_lost_or_duplicated"]
    assert soak["every_page_back"] and soak["pages_in_use_end"] == 0
    assert soak["requests_running_end"] == 0 and soak["requests_waiting_end"] == 0
    assert soak["rss_end_bytes"] > 0

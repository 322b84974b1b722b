"""A smoke run of benches/speculative.py (not a course day): the shipped tiny chat model, the
first two requests of each committed trace, short answers, one run of four modes in fresh
processes. The report must hold every row and the relations that hold on any machine: every
mode's answers are plain greedy's, token for token. No timing is asserted."""

import json
import subprocess
import sys

import pytest
from helpers import BENCHES, load_bench, offline_env

from tiny_llm_support import load_tokenizer
from tiny_llm_support.models import tiny_chat_dir

load_bench("trace_run")
bench = load_bench("speculative")

MODES = ["plain", "lookup-k2", "draft-self-k2", "mlx-lm-draft-1layer-k2"]
REQUESTS, MAX_TOKENS, BATCH_SIZES = 2, 12, [1, 2]


@pytest.mark.parametrize("name", bench.TRACE_NAMES)
def test_committed_traces_are_the_ones_the_bench_expects(name):
    path = bench.DEFAULT_TRACES[name]
    data, sha = bench.read_trace(path)
    assert sha == bench.DEFAULT_TRACE_SHA256[name], "update DEFAULT_TRACE_SHA256 with the file"
    # the rule still gives the same file from qa.txt and the tiny tokenizer
    assert bench.make_trace_file(name, load_tokenizer(tiny_chat_dir())) == path.read_text()
    assert len(data["requests"]) == 18 and data["max_tokens"] == 128
    grounded = [r["context"] == "harrowfield" for r in data["requests"]]
    assert all(grounded) if name == "grounded" else not any(grounded)


def test_a_changed_committed_trace_is_refused(tmp_path, monkeypatch, capsys):
    for name in bench.TRACE_NAMES:
        text = bench.DEFAULT_TRACES[name].read_text()
        (tmp_path / f"speculative-{name}.json").write_text(
            text.replace('"max_tokens": 128', '"max_tokens": 64')
        )
    changed = {name: tmp_path / f"speculative-{name}.json" for name in bench.TRACE_NAMES}
    monkeypatch.setattr(bench, "DEFAULT_TRACES", changed)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--trace-dir", str(tmp_path), "--no-openblas"])
    assert exit_info.value.code == 2
    assert "the trace file changed" in capsys.readouterr().err


def test_modes_are_parsed_or_refused():
    assert bench.parse_mode("lookup-k4") == bench.Mode("lookup-k4", "engine", "lookup", 4)
    assert bench.parse_mode("mlx-lm-draft-2layers-k3").draft_layers == 2
    assert bench.parse_mode("draft-self-k2").draft_layers is None
    for bad in ("mlx-lm-lookup-k2", "lookup-k0", "draft-k4", "fast"):
        with pytest.raises(ValueError):
            bench.parse_mode(bad)


def test_bench_speculative_smoke(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "benches", "speculative", "--device", "cpu", "--repeats", "1"]
    cmd += ["--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--modes", *MODES]
    cmd += ["--batch-sizes", *map(str, BATCH_SIZES), "--json-output", str(out)]
    done = subprocess.run(
        cmd, env=offline_env(tmp_path), capture_output=True, text=True, cwd=BENCHES.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target identical answers: 0 mismatched: met" in done.stdout

    report = json.loads(out.read_text())
    assert report["benchmark"] == "speculative"
    settings = report["settings"]
    assert settings["max_tokens"] == MAX_TOKENS and settings["greedy"]
    for name in bench.TRACE_NAMES:
        about = settings["traces"][name]
        assert about["file_sha256"] == bench.DEFAULT_TRACE_SHA256[name]
        assert about["is_committed_trace"] and about["prompt_ids_from"] == "trace"
        assert about["used_requests"] == REQUESTS
    assert set(settings["drafts"]) == {"self", "1"}
    assert settings["drafts"]["1"]["num_layers"] == 1
    assert settings["modes"]["draft-self-k2"]["draft_is_target"] is True
    assert [run["mode"] for run in report["runs"]] == MODES

    for run in report["runs"]:
        sizes = [1] if run["mode"].startswith("mlx-lm-") else BATCH_SIZES
        shape = [(r["batch_size"], r["trace"]) for r in run["rows"]]
        assert shape == [(b, t) for b in sizes for t in bench.TRACE_NAMES], run["mode"]
        for row in run["rows"]:
            where = f"{run['mode']} {row['trace']} b{row['batch_size']}"
            assert row["requests"] == REQUESTS, where
            assert row["mismatched_requests"] == 0, (where, row["first_mismatch"])
            assert row["mismatched_texts"] == 0, where
            assert 0 < row["generated_tokens"] <= REQUESTS * MAX_TOKENS, where
            assert row["decode_tokens"] <= row["generated_tokens"], where
            assert set(row["finish_reasons"]) <= {"stop", "length"}, where
            if run["mode"] == "plain":
                assert row["tokens_per_row"] == 1.0 and row["proposed"] == 0, where
            else:
                assert row["proposed"] > 0 and 0 <= row["accepted"] <= row["proposed"], where
            if run["mode"] == "draft-self-k2" and row["finish_reasons"] == ["length"]:
                # the target as its own draft: every guess kept (none past an EOS here)
                assert row["accepted"] == row["proposed"], where

    lines = report["summary"]["rows"]
    assert {(x["mode"], x["trace"], x["batch_size"]) for x in lines} == {
        (m, t, b)
        for m in MODES
        for t in bench.TRACE_NAMES
        for b in ([1] if m.startswith("mlx-lm-") else BATCH_SIZES)
    }
    for x in lines:
        assert x["mismatched_requests"] == 0 and x["requests_checked"] == REQUESTS
        assert x["speedup_vs_plain"] is not None
    targets = report["targets"]
    assert set(targets["lookup"]) == {"lookup-k2"}
    assert isinstance(targets["lookup"]["lookup-k2"]["met"], bool)
    assert targets["identical_answers"] == {"mismatched_requests": 0, "met": True}
    answers = report["summary"]["plain_answers"]
    assert set(answers) == set(bench.TRACE_NAMES)
    for plain in answers.values():
        assert plain["batch_size"] == 1 and set(plain["same_ids_at_batch_sizes"]) == {"2"}
        assert len(plain["answers"]) == REQUESTS
        assert all(len(o["token_ids"]) == o["generated_tokens"] > 0 for o in plain["answers"])

"""A smoke run of benches/moe.py (not a course day): a tiny mixture of experts (8 experts, 2 per
token, hidden 64) through both parts, every variant, two samples each. The report must hold every
row and the relations that hold on any machine: every variant's output agrees with grouped's,
one decode token reads exactly k experts, and a disagreement stops the benchmark. No timing is
asserted."""

import json

from helpers import load_bench

load_bench("ceilings")
bench = load_bench("moe")

EXPERTS, PER_TOKEN, HIDDEN, WIDTH, PREFILL, STEPS = 8, 2, 64, 32, 16, 2
TINY = ["--experts", str(EXPERTS), "--experts-per-token", str(PER_TOKEN)]
TINY += ["--hidden", str(HIDDEN), "--expert-width", str(WIDTH), "--vocab", "512"]
TINY += ["--prefill", str(PREFILL), "--decode-batches", "1", "2"]
TINY += ["--decode-steps", str(STEPS), "--repeats", "2", "--matmul-size", "64", "--copy-mb", "8"]
TINY += ["--no-openblas"]


def test_bench_moe_smoke(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert bench.main([*TINY, "--json-output", str(out)]) == 0
    assert "target: grouped at least 3.0x faster than loop" in capsys.readouterr().out

    report = json.loads(out.read_text())
    assert report["benchmark"] == "moe"
    config = report["settings"]["config"]
    assert config["model_type"] == "qwen3_moe" and config["num_hidden_layers"] == 1
    assert (config["num_experts"], config["num_experts_per_tok"]) == (EXPERTS, PER_TOKEN)
    assert config["num_attention_heads"] == 32 and config["num_key_value_heads"] == 4
    assert report["settings"]["weights"]["expert_bytes"] == 3 * WIDTH * HIDDEN * 4
    assert report["summary"]["ceilings"]["bandwidth_ceiling_gbs"] > 0
    block = [r for r in report["runs"] if r["part"] == "block"]
    model = [r for r in report["runs"] if r["part"] == "model"]

    labels = ["prefill 1x16", "decode 1x1", "decode 2x1"]
    assert [(r["label"], r["variant"]) for r in block] == [
        (label, v) for label in labels for v in bench.VARIANTS
    ]
    for r in block:
        assert len(r["samples_s"]) == 2 and r["median_s"] > 0, r["label"]
        assert (
            r["weight_bytes"]
            == EXPERTS * HIDDEN * 4 + r["experts_touched"] * 3 * WIDTH * HIDDEN * 4
        )
        assert PER_TOKEN <= r["experts_touched"] <= EXPERTS
        if r["label"] == "decode 1x1":
            assert r["experts_touched"] == PER_TOKEN  # one token reads exactly k experts

    assert [r["variant"] for r in model] == list(bench.VARIANTS)
    for r in model:
        assert r["prefill_tokens"] == PREFILL and len(r["prefill_samples_s"]) == 2
        parts = r["decode_bytes_per_step"]
        assert parts["experts"] == PER_TOKEN * 3 * WIDTH * HIDDEN * 4
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
        assert r["decode_gb_per_s"] > 0

    agreement = report["summary"]["agreement"]
    assert agreement["ok"] and agreement["largest_relative_diff"] <= bench.AGREEMENT_RTOL
    wheres = {c["where"] for c in agreement["checks"]}
    assert wheres == {f"block {label}" for label in labels} | {"model logits"}
    assert {c["variant"] for c in agreement["checks"]} == {"loop", "mlx-lm"}

    targets = report["targets"]
    assert targets["checked"]
    assert isinstance(targets["grouped_speedup_over_loop_prefill"]["met"], bool)
    assert set(targets["grouped_time_over_mlx_lm"]["values"]) == set(labels)


def test_a_disagreement_stops_the_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "AGREEMENT_RTOL", -1.0)  # any difference, even none, is too much
    out = tmp_path / "moe.json"
    args = [*TINY, "--parts", "block", "--json-output", str(out)]
    assert bench.main(args) == 1
    assert "differs from grouped" in capsys.readouterr().err
    assert not out.exists()


def test_bench_moe_own_kernel_smoke(tmp_path, capsys):
    """--own-kernel (chapter 5.3): a fourth variant in every row, checked against grouped, and
    its two targets; the default file name says own-kernel (the 4.6 JSON stays as it is)."""
    out = tmp_path / "moe-own.json"
    args = [*TINY, "--repeats", "1", "--own-kernel", "--json-output", str(out)]
    assert bench.main(args) == 0
    assert "target: own-kernel at least 3.0x faster than loop" in capsys.readouterr().out
    report = json.loads(out.read_text())
    variants = (*bench.VARIANTS, bench.OWN_KERNEL)
    block = [r for r in report["runs"] if r["part"] == "block"]
    labels = ["prefill 1x16", "decode 1x1", "decode 2x1"]
    assert [(r["label"], r["variant"]) for r in block] == [
        (label, v) for label in labels for v in variants
    ]
    model = [r["variant"] for r in report["runs"] if r["part"] == "model"]
    assert model == list(variants)
    checked = {c["variant"] for c in report["summary"]["agreement"]["checks"]}
    assert checked == {"loop", "mlx-lm", bench.OWN_KERNEL}
    targets = report["targets"]
    assert targets["own_kernel_speedup_over_loop_prefill"]["case"] == "prefill 1x16"
    assert set(targets["own_kernel_time_over_grouped_decode"]["values"]) == set(labels[1:])
    assert len(report["settings"]["load_average_at_start"]) == 3
    breakdown = report["summary"]["own_kernel_prefill_breakdown"]
    assert set(breakdown["calls"]) == {"gate", "up", "down"}
    assert breakdown["pairs"] == PREFILL * PER_TOKEN and 0 < breakdown["kernel_s"]

"""A smoke run of benches/token_delivery.py (not a course day): the shipped tiny model, two
streams of three tokens, one run; every token must arrive stamped, after it was sampled."""

import json

from helpers import load_bench

token_delivery = load_bench("token_delivery")


def test_bench_token_delivery_smoke(tmp_path):
    out = tmp_path / "out.json"
    args = ["--streams", "2", "--sequential", "1", "--max-tokens", "3", "--repeats", "1"]
    args += ["--json-output", str(out)]
    assert token_delivery.main(args) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["server"] == "process"
    assert (run["concurrent"]["streams"], run["sequential"]["streams"]) == (2, 1)
    for phase in ("concurrent", "sequential"):
        delays = run[phase]["delays_ms"]
        assert len(delays) >= run[phase]["streams"], "every text chunk carries its stamp"
        assert all(d >= 0 for d in delays), "a token cannot arrive before it was sampled"
        summary = report["summary"]["process"][phase]
        assert summary["delivery_ms"]["count"] == len(delays)
    assert report["targets"]["delivery_p95_ms_at_most"] == 5

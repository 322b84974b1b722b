"""Week 4 Day 2: tensor parallelism on one machine, one rank against several.

For every count in --ranks, fresh processes (1: a plain process; N: N ranks under mlx.launch,
ring backend over 127.0.0.1) build the model (default: Qwen3-0.6B's shape, random weights),
shard it over the ranks and measure on every rank: the memory it holds (weights, KV cache,
peak); a prefill of --prefill-len tokens (median of --repeats after a warm-up); decode steps
at batch 1 after a --context-token prefill (median, after two warm-up steps); and, on N > 1
ranks, one all_sum of a decode-sized [1, E] and a prefill-sized [prefill-len, E] message.
Beside them, the arithmetic: two all-reduces of hidden_size values per token and block.

    pdm run bench-tensor-parallel                       # 0.6B shape, 1 and 2 ranks
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches import harness
from benches.ceilings import timed
from tiny_llm_support import choose_device, launch
from tiny_llm_support.cli import DTYPES, int_at_least, load_solution

ALL_SUM_REPEATS = 20


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank (`python -m benches tensor-parallel --child-spec FILE`): its memory and times."""
    s, ranks = spec["settings"], spec["ranks"]
    group = harness.join_group(spec)
    choose_device(s["device"])
    api = load_solution(s["solution"])
    bench_model = harness.BenchModel.from_dict(spec["model"])
    ckpt = bench_model.load(s["dtype"])  # the same random weights on every rank
    max_seq_len = max(s["prefill_len"], s["context"] + s["decode_steps"] + 2)
    model = api.Qwen3Model(ckpt, max_seq_len=max_seq_len)
    if ranks > 1:
        model.shard(group)
    del ckpt
    gc.collect()
    mx.clear_cache()
    weights_bytes = mx.get_active_memory()  # what this rank holds: its share and the replicas
    mx.reset_peak_memory()
    high = bench_model.token_ids[1]  # Qwen3's control tokens start here: prompts avoid them
    ids = mx.random.randint(0, high, (1, s["prefill_len"]), key=mx.random.key(1))
    prefill = []  # each prefill on a fresh cache, the first one a warm-up
    for _ in range(s["repeats"] + 1):
        cache = model.create_kv_cache()
        prefill.append(timed(lambda c=cache: model(ids, 0, c, logits_to_keep=1)))
        for layer_cache in cache:
            layer_cache.release()
    context = mx.random.randint(0, high, (1, s["context"]), key=mx.random.key(2))
    cache = model.create_kv_cache()
    logits = model(context, 0, cache, logits_to_keep=1)  # [1, 1, V]
    decode = []  # greedy steps after the context, the first two a warm-up
    for offset in range(s["context"], s["context"] + s["decode_steps"] + 2):
        token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]  # [1, 1]
        start = time.perf_counter()
        logits = model(token, offset, cache)
        mx.eval(logits)
        decode.append(time.perf_counter() - start)
    prefill, decode = prefill[1:], decode[2:]
    record = {"rank": group.rank(), "ranks": ranks, "weights_bytes": weights_bytes,
              "kv_cache_bytes": sum(c.keys.nbytes + c.values.nbytes for c in cache),
              "peak_bytes": mx.get_peak_memory(), "prefill_s": prefill,
              "prefill_ms_median": harness.median(prefill) * 1000, "decode_step_s": decode,
              "decode_step_ms_median": harness.median(decode) * 1000}  # fmt: skip
    if ranks > 1:  # one all_sum of each message, median after a warm-up
        e, dtype = bench_model.qwen3_config.hidden_size, DTYPES[s["dtype"]]
        for message, rows in (("decode", 1), ("prefill", s["prefill_len"])):
            x = mx.ones((rows, e), dtype=dtype)
            times = [timed(lambda x=x: mx.distributed.all_sum(x, group=group))
                     for _ in range(ALL_SUM_REPEATS + 1)]  # fmt: skip
            record[f"all_sum_ms_{message}_message"] = harness.median(times[1:]) * 1000
    return record


def by_ranks(settings: dict, config, runs: list[dict]) -> dict[str, dict]:
    """Per rank count: rank 0's medians (every rank waits for the others in each all_sum), each
    rank's memory, and what the two all-reduces per block move per token (arithmetic)."""
    rows, size = {}, DTYPES[settings["dtype"]].size
    for n in dict.fromkeys(r["ranks"] for r in runs):
        per_rank = [r for r in runs if r["ranks"] == n]
        first = per_rank[0]
        per_token = 2 * config.num_hidden_layers * config.hidden_size * size * (n > 1)  # 1: none
        rows[str(n)] = {
            "prefill_ms": first["prefill_ms_median"],
            "prefill_tokens_per_s": settings["prefill_len"] / first["prefill_ms_median"] * 1000,
            "decode_step_ms": first["decode_step_ms_median"],
            **{f"{what}_mib_per_rank": [r[f"{what}_bytes"] / 2**20 for r in per_rank]
               for what in ("weights", "kv_cache", "peak")},
            "all_sum_ms_decode_message": first.get("all_sum_ms_decode_message"),
            "all_sum_ms_prefill_message": first.get("all_sum_ms_prefill_message"),
            "all_reduces_per_forward_pass": 2 * config.num_hidden_layers * (n > 1),
            "bytes_all_reduced_per_token": per_token,
            # a ring all-reduce sends (and receives) 2 (N - 1) / N of the message on every rank
            "bytes_sent_per_rank_per_token": per_token * 2 * (n - 1) / n,
        }  # fmt: skip
    return rows


def summary_table(report: dict[str, Any]) -> str:
    mib = lambda values: " ".join(f"{v:,.0f}" for v in values)
    ms = lambda value: "-" if value is None else f"{value:.2f}"
    rows = [(n, f"{r['prefill_ms']:,.0f}", f"{r['decode_step_ms']:.1f}",
             mib(r["weights_mib_per_rank"]), mib(r["kv_cache_mib_per_rank"]),
             mib(r["peak_mib_per_rank"]), ms(r["all_sum_ms_decode_message"]),
             ms(r["all_sum_ms_prefill_message"]), f"{r['bytes_all_reduced_per_token']:,}")
            for n, r in report["summary"]["by_ranks"].items()]  # fmt: skip
    head = ("ranks", "prefill ms", "decode ms", "weights MiB/rank", "KV MiB/rank",
            "peak MiB/rank", "all_sum [1, E] ms", "all_sum [T, E] ms", "all-reduced B/token")  # fmt: skip
    return harness.table(head, rows, "tensor parallelism (times: rank 0's medians)")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.bench_parser("bench-tensor-parallel", "Tensor parallelism: 1 rank against N.")
    harness.add_model_arguments(p, "qwen3-0.6b")
    p.set_defaults(seed=0)  # the random weights' seed
    r = p.add_argument_group("runs")
    r.add_argument("--ranks", type=int_at_least(1), nargs="+", default=[1, 2])
    r.add_argument("--prefill-len", type=int_at_least(1), default=512)
    r.add_argument("--context", type=int_at_least(1), default=512, help="tokens before decode")
    r.add_argument("--decode-steps", type=int_at_least(1), default=32)
    r.add_argument("--repeats", type=int_at_least(1), default=3, help="prefill passes measured")
    harness.add_output_arguments(r, "tensor-parallel-<model>[-<N>layers].json")
    args = p.parse_args(argv)
    model = harness.bench_model_from_args(p, args)
    config = model.qwen3_config
    longest = max(args.prefill_len, args.context + args.decode_steps + 2)
    if longest > config.max_position_embeddings:
        p.error(f"{longest} positions (--prefill-len, or --context + --decode-steps) exceed "
                f"the model's max_position_embeddings ({config.max_position_embeddings})")  # fmt: skip
    for ranks in args.ranks:
        if problem := launch.group_problem(config, ranks):
            p.error(f"--ranks {ranks}: {problem}")
    layers = "" if model.num_layers == model.original_num_layers else f"-{model.num_layers}layers"
    name = f"tensor-parallel-{harness.model_slug(model)}{layers}.json"
    harness.set_output_paths(p, args, harness.RESULTS / name)

    started = time.time()
    harness.log_model(model, args)
    settings = {**harness.arguments_json(args, ["json_output"]),
                "device": harness.device_name(args.device)}  # fmt: skip
    shared = {"model": model.to_dict(), "settings": settings, "solution": args.solution}
    label = lambda spec: f"{spec['ranks']} rank(s)"
    line = lambda rs: f"{label(rs[0])}: decode step {rs[0]['decode_step_ms_median']:.1f} ms"
    with tempfile.TemporaryDirectory(prefix="bench-tensor-parallel-") as tmp:
        specs = [{**shared, "ranks": n} for n in args.ranks]
        by_run = harness.run_rank_plan(__name__, specs, Path(tmp), label, line)
    runs = [record for records in by_run for record in records]
    summary = {"by_ranks": by_ranks(settings, config, runs)}
    report = harness.report("tensor-parallel", started, {**settings, "model": model.describe()},
                            runs, summary)  # fmt: skip
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0

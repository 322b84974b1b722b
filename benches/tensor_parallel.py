"""Tensor parallelism (Week 4 Day 2) on one machine: one rank against several.

For every rank count in --ranks, fresh processes build the same model with random weights (the
Qwen3-0.6B shape by default: same FLOPs and bytes as the real model, no download), shard it
over the ranks (N = 1: one plain process, no sharding; N > 1: N processes started by
mlx.launch, ring backend over 127.0.0.1) and measure, on every rank:

- memory: MLX's active memory once the model is built and the full weights are dropped (the
  weights this rank holds), the KV cache after the decode run, and the peak of the runs;
- prefill: one forward pass of --prefill-len tokens on an empty cache (median of --repeats,
  after one warm-up pass);
- decode: batch 1, one token per step after a --context-token prefill (median of
  --decode-steps steps, after two warm-up steps);
- all_sum: one all-reduce of a decode-sized [1, E] and a prefill-sized [prefill-len, E]
  message (median of 20, after a warm-up), where N > 1.

The arithmetic is written beside the measurements: two all-reduces per block, each of
hidden_size values per token, so 2 x layers x hidden_size x bytes-per-value per token.

    pdm run bench-tensor-parallel                       # 0.6B shape, 1 and 2 ranks
    pdm run bench-tensor-parallel --num-layers 2 --prefill-len 32 --context 32 \\
        --decode-steps 4 --repeats 1                    # a smoke run, under a minute

Writes benches/results/tensor-parallel-<model>[-<n>layers].json (or --json-output).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import mlx.core as mx
from ceilings import timed
from common import (
    EMBEDDED_CONFIGS,
    RESULTS,
    BenchModel,
    add_output_arguments,
    bench_parser,
    check_outputs,
    replace_file,
    resolve_bench_model,
    run_in_own_session,
)

from tiny_llm_support import Qwen3Config, blas_info
from tiny_llm_support.cli import DTYPES, add_solution_argument, int_at_least, load_solution
from tiny_llm_support.launch import group_problem, launch

ALL_SUM_REPEATS = 20


# --- the model -----------------------------------------------------------------------------


def bench_model(args: argparse.Namespace) -> BenchModel:
    """The model's shape (an embedded config: no download), random weights, --num-layers."""
    return resolve_bench_model(args.model, random=True, num_layers=args.num_layers)


# --- one rank ------------------------------------------------------------------------------


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def measure_prefill(model, args: argparse.Namespace, tokens: mx.array) -> list[float]:
    """Seconds of each prefill pass of --prefill-len tokens on a fresh cache (warm-up dropped)."""
    times = []
    for _ in range(args.repeats + 1):
        cache = model.create_kv_cache()
        times.append(timed(lambda cache=cache: model(tokens, 0, cache, logits_to_keep=1)))
        for layer_cache in cache:
            layer_cache.release()
    return times[1:]


def measure_decode(model, args: argparse.Namespace, context: mx.array) -> tuple[list[float], int]:
    """Seconds of each decode step after a --context-token prefill (two warm-up steps dropped),
    and the bytes of the KV cache at the end."""
    cache = model.create_kv_cache()
    logits = model(context, 0, cache, logits_to_keep=1)
    offset, times = context.shape[1], []
    for _ in range(args.decode_steps + 2):
        token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]  # [1, 1]
        start = time.perf_counter()
        logits = model(token, offset, cache)
        mx.eval(logits)
        times.append(time.perf_counter() - start)
        offset += 1
    kv_bytes = sum(c.keys.nbytes + c.values.nbytes for c in cache)  # dense buffers, capacity
    return times[2:], kv_bytes


def measure_all_sum(group, shape: tuple[int, int], dtype: mx.Dtype) -> float:
    """Median milliseconds of one all_sum of an array of `shape` over the group."""
    x = mx.ones(shape, dtype=dtype)
    times = [
        timed(lambda: mx.distributed.all_sum(x, group=group)) for _ in range(ALL_SUM_REPEATS + 1)
    ]
    return median_ms(times[1:])


def worker(args: argparse.Namespace) -> int:
    """One rank's measurements, written to --out-dir/rank<r>.json."""
    group = mx.distributed.init(strict=True, backend="ring") if args.worker_ranks > 1 else None
    rank = group.rank() if group is not None else 0
    api = load_solution(args.solution)
    shape = bench_model(args)
    config = shape.qwen3_config
    max_seq_len = max(args.prefill_len, args.context + args.decode_steps + 2)
    ckpt = shape.load(args.dtype)  # the same random weights on every rank
    model = api.Qwen3Model(ckpt, max_seq_len=max_seq_len)
    if group is not None:
        model.shard(group)
    del ckpt
    gc.collect()
    mx.clear_cache()
    weights_bytes = mx.get_active_memory()  # what this rank holds: its share and the replicas
    mx.reset_peak_memory()

    high = shape.token_ids[1]  # Qwen3's control tokens start here: prompts avoid them
    ids = mx.random.randint(0, high, (1, args.prefill_len), key=mx.random.key(1))
    prefill = measure_prefill(model, args, ids)
    context = mx.random.randint(0, high, (1, args.context), key=mx.random.key(2))
    decode, kv_bytes = measure_decode(model, args, context)
    result = {
        "rank": rank,
        "ranks": args.worker_ranks,
        "weights_bytes": weights_bytes,
        "kv_cache_bytes": kv_bytes,
        "peak_bytes": mx.get_peak_memory(),
        "prefill_s": prefill,
        "prefill_ms_median": median_ms(prefill),
        "decode_step_s": decode,
        "decode_step_ms_median": median_ms(decode),
    }
    if group is not None:
        e = config.hidden_size
        dtype = DTYPES[args.dtype]
        result["all_sum_ms_decode_message"] = measure_all_sum(group, (1, e), dtype)
        result["all_sum_ms_prefill_message"] = measure_all_sum(group, (args.prefill_len, e), dtype)
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    return 0


# --- the parent ----------------------------------------------------------------------------


def run_ranks(args: argparse.Namespace, ranks: int, argv: list[str]) -> list[dict]:
    """Run the worker as `ranks` fresh processes; every rank's JSON, rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [str(Path(__file__).resolve()), *argv, "--worker-ranks", str(ranks)]
        command += ["--out-dir", tmp]
        if ranks == 1:  # a session of its own, as the ranks: Ctrl-C reaches this process alone
            status = run_in_own_session([sys.executable, *command])
        else:
            status = launch(command, ranks)
        found = [Path(tmp, f"rank{r}.json") for r in range(ranks)]
        if status != 0 or not all(p.is_file() for p in found):
            raise RuntimeError(f"the run with {ranks} ranks failed (exit status {status})")
        return [json.loads(p.read_text()) for p in found]


def communication(config: Qwen3Config, dtype: mx.Dtype, ranks: int) -> dict:
    """What the two all-reduces per block move for one token (arithmetic, not measured); one
    rank reduces nothing."""
    sharded = ranks > 1
    per_token = 2 * config.num_hidden_layers * config.hidden_size * dtype.size * sharded
    return {
        "all_reduces_per_forward_pass": 2 * config.num_hidden_layers * sharded,
        "bytes_all_reduced_per_token": per_token,
        # a ring all-reduce sends (and receives) 2 (N - 1) / N of the message on every rank
        "bytes_sent_per_rank_per_token": per_token * 2 * (ranks - 1) / ranks,
    }


def summary(args: argparse.Namespace, config: Qwen3Config, runs: dict[int, list[dict]]) -> dict:
    dtype = DTYPES[args.dtype]
    rows = {}
    for ranks, per_rank in runs.items():
        first = per_rank[0]  # every rank waits for the others in each all_sum: rank 0 stands
        rows[str(ranks)] = {
            "prefill_ms": first["prefill_ms_median"],
            "prefill_tokens_per_s": args.prefill_len / first["prefill_ms_median"] * 1000,
            "decode_step_ms": first["decode_step_ms_median"],
            "weights_mib_per_rank": [r["weights_bytes"] / 2**20 for r in per_rank],
            "kv_cache_mib_per_rank": [r["kv_cache_bytes"] / 2**20 for r in per_rank],
            "peak_mib_per_rank": [r["peak_bytes"] / 2**20 for r in per_rank],
            "all_sum_ms_decode_message": first.get("all_sum_ms_decode_message"),
            "all_sum_ms_prefill_message": first.get("all_sum_ms_prefill_message"),
            **communication(config, dtype, ranks),
        }
    return rows


def machine() -> dict:
    uname = platform.uname()
    return {
        "platform": platform.platform(),
        "machine": uname.machine,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "blas": blas_info()["blas"],
    }


def build_parser() -> argparse.ArgumentParser:
    positive = int_at_least(1)
    p = bench_parser(
        "bench-tensor-parallel", "Tensor parallelism on one machine: 1 rank against N ranks."
    )
    p.add_argument(
        "--model", choices=sorted(EMBEDDED_CONFIGS), default="qwen3-0.6b", help="model shape"
    )
    p.add_argument("--num-layers", type=positive, default=None, help="keep fewer layers")
    p.add_argument("--ranks", type=positive, nargs="+", default=[1, 2])
    add_solution_argument(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--prefill-len", type=positive, default=512)
    p.add_argument("--context", type=positive, default=512, help="tokens cached before decode")
    p.add_argument("--decode-steps", type=positive, default=32)
    p.add_argument("--repeats", type=positive, default=3, help="prefill passes measured")
    add_output_arguments(p, "tensor-parallel-<model>[-<n>layers].json")
    p.add_argument("--worker-ranks", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker_ranks is not None:
        return worker(args)
    config = bench_model(args).qwen3_config
    longest = max(args.prefill_len, args.context + args.decode_steps + 2)
    if longest > config.max_position_embeddings:
        sys.exit(
            f"error: {longest} positions (--prefill-len, or --context + --decode-steps) exceed "
            f"the model's max_position_embeddings ({config.max_position_embeddings})"
        )
    for ranks in args.ranks:
        problem = group_problem(config, ranks)
        if problem:
            parser.error(f"--ranks {ranks}: {problem}")
    layers = "" if args.num_layers is None else f"-{config.num_hidden_layers}layers"
    out = args.json_output or RESULTS / f"tensor-parallel-{args.model}{layers}.json"
    check_outputs(parser, out)
    started = time.time()
    runs = {}
    for ranks in args.ranks:
        print(f"{ranks} rank(s) ...", flush=True)
        runs[ranks] = run_ranks(args, ranks, argv)
    rows = summary(args, config, runs)
    for ranks, row in rows.items():
        print(
            f"{ranks} rank(s): prefill {args.prefill_len} tokens {row['prefill_ms']:.1f} ms, "
            f"decode step {row['decode_step_ms']:.1f} ms, weights per rank "
            f"{', '.join(f'{m:.0f}' for m in row['weights_mib_per_rank'])} MiB"
            + (
                f", all-reduced per token {row['bytes_all_reduced_per_token']} bytes"
                if ranks > 1
                else ""
            )
        )
    record = {
        "benchmark": "tensor-parallel",
        "arguments": {k: v for k, v in vars(args).items() if k not in ("worker_ranks", "out_dir")},
        "model": {"shape": args.model, "num_layers": config.num_hidden_layers},
        "machine": machine(),
        "seconds": round(time.time() - started, 1),
        "by_ranks": rows,
        "runs": {str(k): v for k, v in runs.items()},
    }
    replace_file(out, json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from tiny_llm_support.cli import run_script

    run_script(main)  # with OpenBLAS preloaded where it helps: the ranks inherit it

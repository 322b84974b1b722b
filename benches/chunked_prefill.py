"""The fairness trade-off of chunked prefill: decode stalls against throughput.

One seeded request trace (random prompt token ids, a fixed output budget per request) is
served with several prefill budgets (`--prefill-steps`, prompt tokens per scheduler
iteration). Every (budget, repeat) runs in a fresh process, after warm-up runs in that process;
repeats alternate forward and reverse budget order, so slow drift of a shared machine does not
favour one budget. The scheduler is the bench's own loop over the course's public API
(Request, BatchingKvCache, Qwen3Model) with batch_generate's policy:

    admit a waiting request when a slot is free and no request is being prefilled
    run one prefill chunk (at most the budget's prompt tokens)
    run one batched decode step for every request in a slot

A request finishes after exactly its output budget (EOS is ignored: random weights would stop
at random places), so every budget does the same work.

Measured per run: output tokens/s, requests/s, wall time; the synchronized time of each batched
decode call; the decode gap, the wall time between two consecutive synchronized decode
completions while at least one request is decoding (prefill chunks in between count, stretches
with no decoding request do not); time to first token (every request arrives at time 0);
prefill chunks. Each budget's row is the median over its runs.

    pdm run bench-chunked-prefill --model tiny --prefill-steps 16 64 --num-seqs 4
    pdm run bench-chunked-prefill --model qwen3-0.6b --num-layers 4 --prefill-steps 32 128 512

Writes JSON (the trace itself and its SHA-256, host, MLX, BLAS, model, arguments, raw runs,
per-budget medians) and a PNG of p95 decode gap against output throughput.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `common` sits beside this file
    sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from common import (  # noqa: E402
    BenchModel,
    blas_info,
    canonical_json,
    host_info,
    int_at_least,
    median,
    mlx_info,
    openblas_preload_env,
    resolve_bench_model,
    summarize,
    write_json,
)

from tiny_llm_support import choose_device, gpu_available  # noqa: E402

SCHEMA = "tiny-llm/bench-chunked-prefill/v1"
SOLUTIONS = {"ref": "tiny_llm_ref", "tiny_llm": "tiny_llm"}
DTYPES = ("float32", "bfloat16", "float16")
WARMUP_OUTPUT_BUDGET = 4

# The per-run numbers that are aggregated (median over runs) for each budget.
SCALAR_METRICS = (
    "output_tokens_per_s",
    "requests_per_s",
    "wall_s",
    "decode_step_ms_median",
    "decode_step_ms_p95",
    "decode_step_ms_max",
    "decode_gap_ms_median",
    "decode_gap_ms_p95",
    "decode_gap_ms_max",
    "ttft_ms_median",
    "ttft_ms_p95",
    "prefill_chunks",
    "decode_steps",
)


# --- the trace ---------------------------------------------------------------------------


@dataclass
class Trace:
    """Prompts as token ids, and how many tokens each request must generate."""

    prompts: list[list[int]]
    output_budgets: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "output_budgets": self.output_budgets}

    def sha256(self) -> str:
        return hashlib.sha256(canonical_json(self.to_dict()).encode("ascii")).hexdigest()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_budgets)


def make_trace(
    seed: int,
    num_seqs: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    token_ids: tuple[int, int],
    excluded_ids: Sequence[int] = (),
) -> Trace:
    """A deterministic trace: lengths uniform in the closed ranges, ids uniform over
    [low, high) minus `excluded_ids`. Python's `random` keeps its stream stable across
    versions, so a seed names the same trace everywhere."""
    low, high = token_ids
    excluded = sorted({i for i in excluded_ids if low <= i < high})
    choices = high - low - len(excluded)
    if choices < 1:
        raise ValueError("no token ids to draw prompts from")
    rng = random.Random(seed)
    prompts, budgets = [], []
    for _ in range(num_seqs):
        length = rng.randint(*input_len)
        budgets.append(rng.randint(*output_len))
        prompts.append([_nth_allowed(rng.randrange(choices), low, excluded) for _ in range(length)])
    return Trace(prompts, budgets)


def _nth_allowed(n: int, low: int, excluded: list[int]) -> int:
    """The n-th id (from 0) counting up from `low` and skipping the sorted `excluded` ids."""
    token = low + n
    for e in excluded:
        if e <= token:
            token += 1
        else:
            break
    return token


def warmup_trace(args: argparse.Namespace, model: BenchModel) -> Trace:
    """A short trace for the warm-up runs, from another seed: one longest prompt (so the
    largest chunks and caches have been allocated once), the rest of a batch at the shortest
    length, a few output tokens each."""
    n = min(args.num_seqs, args.batch_size)
    budget = (min(args.max_output_len, WARMUP_OUTPUT_BUDGET),) * 2
    seed = args.seed + 1_000_003
    longest = make_trace(
        seed, 1, (args.max_input_len,) * 2, budget, model.token_ids, model.excluded_ids
    )
    rest = make_trace(
        seed + 1, n - 1, (args.min_input_len,) * 2, budget, model.token_ids, model.excluded_ids
    )
    return Trace(longest.prompts + rest.prompts, longest.output_budgets + rest.output_budgets)


class TokenIdTokenizer:
    """Lets `Request` take a prompt that is already token ids. EOS is never recognised, so a
    request stops only when the bench says so; nothing is detokenized (no text is needed)."""

    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, prompt: Sequence[int]) -> list[int]:
        return list(prompt)

    def detokenizer(self) -> _NoText:
        return _NoText()


class _NoText:
    text = ""

    def add_token(self, token_id: int) -> str:
        return ""

    def finalize(self) -> str:
        return ""


# --- one run: the scheduler loop -----------------------------------------------------------


def run_trace(
    model: Any,
    api: Any,
    trace: Trace,
    prefill_step: int,
    batch_size: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Serve `trace` with `api` (tiny_llm_ref or tiny_llm) and return the run's metrics.

    Returns {"metrics": scalar numbers (SCALAR_METRICS and totals), "raw": per-step and
    per-request times in seconds}.
    """
    tokenizer = TokenIdTokenizer()
    n = len(trace.prompts)
    pending = deque(range(n))
    slots: list[Any | None] = [None] * batch_size
    batch_cache = [api.BatchingKvCache(batch_size) for _ in range(model.num_hidden_layers)]
    prefilling = None
    ttft: list[float | None] = [None] * n
    finished: list[float | None] = [None] * n
    step_times: list[float] = []  # each batched decode call, synchronized
    gaps: list[float] = []  # between decode completions while a request is decoding
    chunk_times: list[float] = []  # each prefill chunk, synchronized
    decode_tokens = 0  # rows of all decode steps (the first token of a request comes from prefill)
    last_decode_end: float | None = None  # None while no request is decoding

    def done(request: Any) -> bool:
        return len(request.generated) >= trace.output_budgets[request.prompt_idx]

    def finish(request: Any, now: float) -> None:
        request.release()
        finished[request.prompt_idx] = now - start

    start = clock()
    try:
        while pending or prefilling is not None or any(r is not None for r in slots):
            if prefilling is None and pending and None in slots:
                idx = pending.popleft()
                prefilling = api.Request(model, tokenizer, trace.prompts[idx], prefill_step, idx)
            if prefilling is not None:
                t = clock()
                prefilling.try_prefill()  # synchronized: materialize() and the first token
                now = clock()
                chunk_times.append(now - t)
                if prefilling.is_prefill_done:
                    ttft[prefilling.prompt_idx] = now - start
                    if done(prefilling):
                        finish(prefilling, now)
                    else:
                        slot = slots.index(None)
                        slots[slot] = prefilling
                        for layer_cache, request_cache in zip(batch_cache, prefilling.kv_cache):
                            layer_cache.add_request(request_cache, slot)
                    prefilling = None
            if any(r is not None for r in slots):
                t = clock()
                active = [i for i, r in enumerate(slots) if r is not None]
                tokens = mx.array([[slots[i].generated[-1]] for i in active], dtype=mx.int32)
                logits = model(tokens, [slots[i].offset for i in active], batch_cache)
                next_tokens = mx.argmax(logits[:, -1, :], axis=-1).tolist()  # synchronizes
                now = clock()
                step_times.append(now - t)
                decode_tokens += len(active)
                if last_decode_end is not None:
                    gaps.append(now - last_decode_end)
                for i, token in zip(active, next_tokens):
                    request = slots[i]
                    request.decode_done(token)
                    if done(request):
                        for layer_cache in batch_cache:
                            layer_cache.remove_request(i)
                        slots[i] = None
                        finish(request, now)
                last_decode_end = now if any(r is not None for r in slots) else None
        wall = clock() - start
    finally:
        for layer_cache in batch_cache:
            layer_cache.release()
        if prefilling is not None:
            prefilling.release()

    steps, gap = summarize(step_times, 1e3), summarize(gaps, 1e3)
    first = summarize([v for v in ttft if v is not None], 1e3)
    metrics = {
        "wall_s": wall,
        "requests": n,
        "prompt_tokens": trace.prompt_tokens,
        "output_tokens": trace.output_tokens,
        "output_tokens_per_s": trace.output_tokens / wall,
        "requests_per_s": n / wall,
        "decode_steps": len(step_times),
        "decode_tokens": decode_tokens,
        "decode_step_ms_median": steps["median"],
        "decode_step_ms_p95": steps["p95"],
        "decode_step_ms_max": steps["max"],
        "decode_gaps": len(gaps),
        "decode_gap_ms_median": gap["median"],
        "decode_gap_ms_p95": gap["p95"],
        "decode_gap_ms_max": gap["max"],
        "ttft_ms_median": first["median"],
        "ttft_ms_p95": first["p95"],
        "ttft_ms_max": first["max"],
        "prefill_chunks": len(chunk_times),
        "prefill_chunk_ms_median": summarize(chunk_times, 1e3)["median"],
        "prefill_chunk_ms_max": summarize(chunk_times, 1e3)["max"],
    }
    raw = {
        "decode_step_s": _rounded(step_times),
        "decode_gap_s": _rounded(gaps),
        "prefill_chunk_s": _rounded(chunk_times),
        "ttft_s": _rounded(ttft),
        "finish_s": _rounded(finished),
    }
    return {"metrics": metrics, "raw": raw}


def _rounded(values: Sequence[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 6) for v in values]


# --- the child process: one (budget, repeat) ----------------------------------------------


def child_main(spec_path: str) -> int:
    """Load the model, warm up, serve the trace once, write the run's JSON."""
    t0 = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"])
    device = choose_device(args.device)
    api = importlib.import_module(SOLUTIONS[args.solution])
    bench_model = BenchModel.from_dict(spec["model"])
    trace = Trace(**spec["trace"])
    if trace.sha256() != spec["trace_sha256"]:
        raise RuntimeError("the trace handed to this process does not match its SHA-256")
    warm = Trace(**spec["warmup_trace"])
    ckpt = bench_model.load(args.dtype)
    mx.eval(list(ckpt.weights.values()))  # mx.load is lazy: read the weights now, not in a run
    max_len = max(len(p) + b for t in (trace, warm) for p, b in zip(t.prompts, t.output_budgets))
    model = api.Qwen3Model(ckpt, max_seq_len=max_len)
    load_s = time.perf_counter() - t0

    budget = spec["prefill_step"]
    warmup_s = []
    for _ in range(args.warmup):
        t = time.perf_counter()
        run_trace(model, api, warm, budget, args.batch_size)
        warmup_s.append(time.perf_counter() - t)
    mx.reset_peak_memory()
    result = run_trace(model, api, trace, budget, args.batch_size)
    result.update(
        {
            "prefill_step": budget,
            "repeat": spec["repeat"],
            "order": spec["order"],
            "sequence": spec["sequence"],
            "pid": os.getpid(),
            "device": device,
            "blas": blas_info(),
            "peak_memory_bytes": mx.get_peak_memory(),
            "load_s": load_s,
            "warmup_s": warmup_s,
        }
    )
    write_json(spec["output"], result)
    return 0


# --- the parent: plan, launch, aggregate, report -------------------------------------------


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench-chunked-prefill",
        description="Decode stalls against throughput for several chunked-prefill budgets. "
        "Each (budget, repeat) runs in a fresh process; repeats alternate forward and "
        "reverse budget order.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default="tiny",
        help="tiny, a shortcut (qwen3-0.6b, qwen3-1.7b, ...), a checkpoint "
        "directory, or the path of a config.json (random weights)",
    )
    m.add_argument(
        "--random-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random weights with the model's shapes (no download); default: on for "
        "qwen3-0.6b/qwen3-1.7b and config.json paths, off for checkpoints",
    )
    m.add_argument(
        "--num-layers",
        type=int_at_least(1),
        default=None,
        help="keep only this many layers (a smaller model; any number with random weights)",
    )
    m.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weights and activations (default: float32 on the CPU, bfloat16 on a GPU)",
    )
    m.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    m.add_argument(
        "--solution",
        choices=sorted(SOLUTIONS),
        default="ref",
        help="ref: tiny_llm_ref; tiny_llm: your own solution",
    )
    m.add_argument(
        "--offline",
        action="store_true",
        help="never download: real weights must be in the Hugging Face cache",
    )
    m.add_argument(
        "--no-openblas",
        action="store_true",
        help="on Linux, do not preload Debian's OpenBLAS into the runs",
    )
    t = p.add_argument_group("trace and schedule")
    t.add_argument(
        "--prefill-steps",
        type=int_at_least(1),
        nargs="+",
        default=[32, 128, 512],
        metavar="N",
        help="prefill budgets to compare (prompt tokens per iteration)",
    )
    t.add_argument("--num-seqs", type=int_at_least(1), default=8, help="requests in the trace")
    t.add_argument("--batch-size", type=int_at_least(1), default=4, help="decode slots")
    t.add_argument("--min-input-len", type=int_at_least(1), default=64)
    t.add_argument("--max-input-len", type=int_at_least(1), default=512)
    t.add_argument("--min-output-len", type=int_at_least(1), default=32)
    t.add_argument("--max-output-len", type=int_at_least(1), default=32)
    t.add_argument("--seed", type=int_at_least(0), default=0, help="the trace (and random weights)")
    r = p.add_argument_group("runs and output")
    r.add_argument(
        "--warmup",
        type=int_at_least(0),
        default=1,
        help="warm-up runs of a short trace in each process before the measured one",
    )
    r.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=2,
        help="processes per budget; odd repeats run the budgets in reverse order",
    )
    r.add_argument(
        "--cooldown-seconds", type=non_negative_float, default=0.0, help="pause between runs"
    )
    r.add_argument(
        "--json-output",
        type=Path,
        default=None,
        help="default: benches/results/chunked-prefill-<model>.json",
    )
    r.add_argument(
        "--plot-output", type=Path, default=None, help="default: the JSON path with .png"
    )
    r.add_argument("--no-plot", action="store_true")
    p.add_argument("--child-spec", help=argparse.SUPPRESS)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> BenchModel:
    """Every check that needs no weights; errors exit through argparse before any run."""
    if args.min_input_len > args.max_input_len:
        p.error(f"--min-input-len {args.min_input_len} > --max-input-len {args.max_input_len}")
    if args.min_output_len > args.max_output_len:
        p.error(f"--min-output-len {args.min_output_len} > --max-output-len {args.max_output_len}")
    dupes = sorted({s for s in args.prefill_steps if args.prefill_steps.count(s) > 1})
    if dupes:
        p.error(f"--prefill-steps lists {', '.join(map(str, dupes))} more than once")
    if args.device == "gpu" and not gpu_available():
        p.error("--device gpu: MLX has no Metal or CUDA device here")
    for path in (args.json_output, args.plot_output):
        if path is not None and path.is_dir():
            p.error(f"{path} is a directory; give a file name")
    try:
        model = resolve_bench_model(
            args.model, args.random_weights, args.num_layers, args.seed, args.offline or None
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        p.error(f"--model {args.model}: {e}")
    longest = args.max_input_len + args.max_output_len
    limit = int(model.config["max_position_embeddings"])
    if longest > limit:
        p.error(
            f"--max-input-len + --max-output-len = {longest} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )
    return model


def plan_runs(budgets: Sequence[int], repeats: int) -> list[tuple[int, str, int]]:
    """(repeat, order, budget) in launch order: repeat 0 forward, 1 reverse, 2 forward..."""
    plan = []
    for r in range(repeats):
        order = "forward" if r % 2 == 0 else "reverse"
        for budget in budgets if order == "forward" else list(reversed(budgets)):
            plan.append((r, order, budget))
    return plan


def aggregate(runs: list[dict[str, Any]], budgets: Sequence[int]) -> list[dict[str, Any]]:
    """Per budget: the median, min and max over its runs of every scalar metric."""
    rows = []
    for budget in budgets:
        mine = [run["metrics"] for run in runs if run["prefill_step"] == budget]
        row: dict[str, Any] = {"prefill_step": budget, "runs": len(mine)}
        for stat, fn in (("median", median), ("min", _min), ("max", _max)):
            row[stat] = {k: fn(m[k] for m in mine) for k in SCALAR_METRICS}
        rows.append(row)
    return rows


def _min(values):
    data = [v for v in values if v is not None]
    return min(data) if data else None


def _max(values):
    data = [v for v in values if v is not None]
    return max(data) if data else None


def default_json_path(model: BenchModel) -> Path:
    name = Path(model.name).name if model.source in ("checkpoint", "config-file") else model.name
    if name == "config.json":
        name = Path(model.name).parent.name or "config"
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-").lower() or "model"
    if model.num_layers != model.original_num_layers:
        slug += f"-{model.num_layers}l"
    if model.random_weights and model.source != "tiny":
        slug += "-random"
    return HERE / "results" / f"chunked-prefill-{slug}.json"


def run_benchmark(args: argparse.Namespace, model: BenchModel) -> dict[str, Any]:
    """Launch one child process per (budget, repeat), then assemble the report."""
    started = time.time()
    trace = make_trace(
        args.seed,
        args.num_seqs,
        (args.min_input_len, args.max_input_len),
        (args.min_output_len, args.max_output_len),
        model.token_ids,
        model.excluded_ids,
    )
    warm = warmup_trace(args, model)
    sha = trace.sha256()
    env, preloaded = (dict(os.environ), None) if args.no_openblas else openblas_preload_env()
    plan = plan_runs(args.prefill_steps, args.repeats)
    log(
        f"model {model.name} ({model.source}, {model.num_layers} layers, "
        f"{model.parameter_count() / 1e6:.1f}M parameters, "
        f"{'random' if model.random_weights else 'checkpoint'} weights), "
        f"{args.dtype} on {_device_name(args.device)}, solution {SOLUTIONS[args.solution]}"
    )
    log(
        f"trace seed {args.seed}: {args.num_seqs} requests, {trace.prompt_tokens} prompt tokens, "
        f"{trace.output_tokens} output tokens, sha256 {sha[:16]}..."
    )
    log(
        f"BLAS for the runs: {'OpenBLAS preloaded: ' + preloaded if preloaded else blas_info()['blas']}"
    )
    log(
        f"{len(plan)} runs: budgets {args.prefill_steps} x {args.repeats} repeats, "
        f"{args.warmup} warm-up run(s) each"
    )

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-chunked-prefill-") as tmp:
        if model.random_weights:
            t = time.perf_counter()
            model.materialize(Path(tmp) / "weights", args.dtype)
            log(f"random weights written in {time.perf_counter() - t:.1f} s")
        common = {
            "args": _jsonable(vars(args)),
            "model": model.to_dict(),
            "trace": trace.to_dict(),
            "trace_sha256": sha,
            "warmup_trace": warm.to_dict(),
        }
        for k, (repeat, order, budget) in enumerate(plan):
            if k and args.cooldown_seconds:
                time.sleep(args.cooldown_seconds)
            spec_path = Path(tmp) / f"run-{k}.json"
            out_path = Path(tmp) / f"result-{k}.json"
            spec = {
                **common,
                "prefill_step": budget,
                "repeat": repeat,
                "order": order,
                "sequence": k,
                "output": str(out_path),
            }
            spec_path.write_text(json.dumps(spec))
            t = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child-spec", str(spec_path)],
                env=env,
                stdout=subprocess.DEVNULL,
            )
            elapsed = time.perf_counter() - t
            if proc.returncode != 0:
                raise SystemExit(
                    f"run {k + 1}/{len(plan)} (prefill step {budget}, repeat {repeat + 1}) "
                    f"failed with exit status {proc.returncode}; its error is above"
                )
            run = json.loads(out_path.read_text())
            run["process_s"] = elapsed
            runs.append(run)
            mt = run["metrics"]
            log(
                f"[{k + 1}/{len(plan)}] prefill step {budget:>5}  repeat {repeat + 1} ({order})  "
                f"{elapsed:6.1f} s in process, run {mt['wall_s']:6.2f} s  "
                f"{mt['output_tokens_per_s']:7.2f} tok/s  "
                f"p95 gap {_ms(mt['decode_gap_ms_p95'])}  blas {run['blas']['blas']}"
            )
        model_description = model.describe()

    return {
        "schema": SCHEMA,
        "created_unix": started,
        "duration_s": time.time() - started,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "arguments": _jsonable(vars(args)),
        "host": host_info(),
        "mlx": mlx_info(),
        "device": runs[0]["device"] if runs else args.device,
        "dtype": args.dtype,
        "solution": SOLUTIONS[args.solution],
        "blas": {
            "parent": blas_info(),
            "runs": sorted({run["blas"]["blas"] for run in runs}),
            "preloaded_by_bench": preloaded,
            "ld_preload": env.get("LD_PRELOAD"),  # what the runs were started with
        },
        "environment": {
            k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD")
        },
        "model": model_description,
        "trace": {
            "seed": args.seed,
            "sha256": sha,
            "num_requests": len(trace.prompts),
            "prompt_lengths": [len(p) for p in trace.prompts],
            "output_budgets": trace.output_budgets,
            "prompt_tokens": trace.prompt_tokens,
            "output_tokens": trace.output_tokens,
            "prompts": trace.prompts,
        },
        "warmup_trace": {"sha256": warm.sha256(), **warm.to_dict()},
        "plan": [{"repeat": r, "order": o, "prefill_step": b} for r, o, b in plan],
        "runs": runs,
        "budgets": aggregate(runs, args.prefill_steps),
    }


def _device_name(requested: str) -> str:
    return "gpu" if requested == "gpu" or (requested == "auto" and gpu_available()) else "cpu"


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items() if k != "child_spec"}


def _ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:7.1f} ms"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def summary_table(report: dict[str, Any]) -> str:
    header = (
        f"{'prefill':>7} {'runs':>4} {'tok/s':>8} {'req/s':>6} {'wall s':>7} "
        f"{'step p50':>9} {'gap p50':>9} {'gap p95':>9} {'gap max':>9} "
        f"{'ttft p50':>9} {'chunks':>6}"
    )
    lines = [header]
    for row in report["budgets"]:
        m = row["median"]
        lines.append(
            f"{row['prefill_step']:>7} {row['runs']:>4} {m['output_tokens_per_s']:>8.2f} "
            f"{m['requests_per_s']:>6.3f} {m['wall_s']:>7.2f} "
            f"{_num(m['decode_step_ms_median'])} {_num(m['decode_gap_ms_median'])} "
            f"{_num(m['decode_gap_ms_p95'])} {_num(m['decode_gap_ms_max'])} "
            f"{_num(m['ttft_ms_median'])} {m['prefill_chunks']:>6.0f}"
        )
    return "\n".join(lines) + "\n(times in ms, medians over runs)"


def _num(value: float | None) -> str:
    return f"{'n/a':>9}" if value is None else f"{value:>9.1f}"


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """p95 decode gap against output throughput, one labeled point per budget (median over
    runs; the bars span the runs' min..max)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot (pdm sync -G dev installs it)")
        return None
    rows = [r for r in report["budgets"] if r["median"]["decode_gap_ms_p95"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    xs = [r["median"]["output_tokens_per_s"] for r in rows]
    ys = [r["median"]["decode_gap_ms_p95"] for r in rows]
    xerr = [
        [x - r["min"]["output_tokens_per_s"] for x, r in zip(xs, rows)],
        [r["max"]["output_tokens_per_s"] - x for x, r in zip(xs, rows)],
    ]
    yerr = [
        [y - r["min"]["decode_gap_ms_p95"] for y, r in zip(ys, rows)],
        [r["max"]["decode_gap_ms_p95"] - y for y, r in zip(ys, rows)],
    ]
    ax.plot(xs, ys, color="0.7", linewidth=1, zorder=1)
    ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o", capsize=3, zorder=2)
    for x, y, r in zip(xs, ys, rows):
        ax.annotate(
            f"prefill {r['prefill_step']}",
            (x, y),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=9,
        )
    model = report["model"]
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("p95 decode gap (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{model['name']} ({model['num_layers']} layers, {report['dtype']}), "
        f"{report['trace']['num_requests']} requests, batch {report['arguments']['batch_size']}\n"
        f"{report['host']['machine']}, {report['host']['cpu_count']} CPUs, "
        f"{', '.join(report['blas']['runs'])}, MLX {report['mlx']['version']}",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child_spec:
        return child_main(args.child_spec)
    model = check_args(parser, args)
    if args.dtype is None:
        args.dtype = "bfloat16" if _device_name(args.device) == "gpu" else "float32"
    if args.json_output is None:
        args.json_output = default_json_path(model)
    if args.plot_output is None:
        args.plot_output = args.json_output.with_suffix(".png")
    report = run_benchmark(args, model)
    write_json(args.json_output, report)
    log(f"wrote {args.json_output}")
    if not args.no_plot and plot(report, args.plot_output):
        log(f"wrote {args.plot_output}")
    print(summary_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

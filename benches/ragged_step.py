"""3.4/4.3: the time of one decode step with B requests, by how the pass reads the KV cache.

Three ways, each (mode, batch) in a fresh process, the modes alternating:

- dense:       the alternate policy's batched decode over dense caches (3.1's BatchingKvCache);
- per-segment: the hybrid pass over a pool read in place, each segment writing its keys/values
               and attending on its own (the order of 3.4's first version, which makes MLX copy
               a layer's pool for every write after a read);
- one-write:   the hybrid pass as it is: every segment's keys/values in one scatter per layer,
               then one paged_attention call per segment length (all decode rows in one).

Each process adds B requests of --context prompt tokens, steps the engine until all of them
decode, then times --steps decode steps; it also reports the peak memory of the run.

    pdm run bench-ragged-step [--model qwen3-0.6b] [--num-layers 8] [--batches 1 4 8]
                              [--context 300] [--steps 12] [--repeats 1]

Writes benches/results/ragged-step-<model>-<host>.json (or --json-output).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiny_llm_support import reexec_with_openblas, startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
from common import (
    add_output_arguments,
    check_outputs,
    host_info,
    host_slug,
    log,
    median,
    summarize,
    write_json,
)
from serving import write_model

ROOT = Path(__file__).resolve().parent.parent
MODES = ("dense", "per-segment", "one-write")
TARGET_RATIO = 1.15  # issue 41: one-write at batch 8 within 1.15x of dense


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="qwen3-0.6b", help="qwen3-0.6b (its shape) or tiny")
    p.add_argument("--num-layers", type=int, default=8, help="layers of the shape's checkpoint")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8], help="requests")
    p.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (mode, batch)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--child", nargs=3, metavar=("DIR", "MODE", "BATCH"), help=argparse.SUPPRESS)
    add_output_arguments(p, "ragged-step-<model>-<host>.json")
    args = p.parse_args(argv)
    for name in ("num_layers", "context", "steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batches) < 1:
        p.error("--batches must be >= 1")
    if args.json_output is None:
        name = f"ragged-step-{args.model.lower()}-{host_slug()}.json"
        args.json_output = ROOT / "benches" / "results" / name
    check_outputs(p, args.json_output)
    return args


def measure(directory: str, mode: str, batch: int, args: argparse.Namespace) -> dict:
    """In this (fresh) process: the decode step times of one mode at one batch size."""
    import mlx.core as mx

    import tiny_llm_ref as ref
    from tiny_llm_support import load_checkpoint

    if mode == "per-segment":  # every cache attends on its own: the first version's order
        ref.TinyKvPagedCache.pages_in_place = property(lambda self: False)
    ckpt = load_checkpoint(directory, dtype="float32")
    longest = args.context + args.steps + 16
    model = ref.Qwen3Model(ckpt, max_seq_len=longest)
    pools = None if mode == "dense" else model.create_kv_pools(16, read_in_place=True)
    engine = ref.Engine(
        model, ckpt.tokenizer, max_seq_len=longest, batch_size=batch, prefill_step=256,
        pools=pools, policy="alternate" if mode == "dense" else "hybrid",
    )  # fmt: skip
    for i in range(batch):  # ordinary ids of the tiny tokenizer (10..509), a prompt per request
        prompt = [(7 * i + 13 * j) % 500 + 10 for j in range(args.context)]
        engine.add_request(prompt, ref.SamplingParams(max_tokens=args.steps + 8, ignore_eos=True))
    slots = engine.scheduler.slots
    while None in slots or not all(r.is_prefill_done for r in slots):
        engine.step()
    engine.step()  # one decode step before timing
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return {"step_ms": summarize(times, 1000), "peak_bytes": mx.get_peak_memory()}


def run_fresh(directory: Path, mode: str, batch: int, argv: list[str]) -> dict:
    """measure() in a process of its own; its last line of output is the record."""
    command = [sys.executable, __file__, *argv, "--child", str(directory), mode, str(batch)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} at batch {batch} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict], batches: list[int]) -> dict:
    """Per batch: each mode's median step (over repeats: the median of their medians) and its
    ratio over dense."""
    out = {}
    for batch in batches:
        medians = {}
        for mode in MODES:
            mine = [
                r["step_ms"]["median"] for r in runs if (r["mode"], r["batch"]) == (mode, batch)
            ]
            medians[mode] = median(mine)
        ratios = {m: medians[m] / medians["dense"] for m in MODES}
        out[str(batch)] = {"median_step_ms": medians, "over_dense": ratios}
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        directory, mode, batch = args.child
        print(json.dumps(measure(directory, mode, int(batch), args)))
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        log(f"writing the checkpoint ({args.model}, {args.num_layers} layers)")
        model = write_model(args, Path(tmp) / "model")
        total, k = args.repeats * len(args.batches) * len(MODES), 0
        for repeat in range(args.repeats):
            for batch in args.batches:
                for mode in MODES:
                    k += 1
                    log(f"[{k}/{total}] {mode} at batch {batch}")
                    record = run_fresh(Path(tmp) / "model", mode, batch, argv)
                    runs.append({"mode": mode, "batch": batch, "repeat": repeat, **record})
    model.pop("config", None)
    settings = {"model": model, "context": args.context, "steps": args.steps}
    settings |= {"repeats": args.repeats, "batches": args.batches}
    report = {"host": host_info(), "settings": settings, "runs": runs}
    report["summary"] = summary(runs, args.batches)
    largest = report["summary"][str(max(args.batches))]["over_dense"]["one-write"]
    report["targets"] = {
        "one_write_over_dense_at_most": TARGET_RATIO,
        "batch": max(args.batches),
        "ratio": largest,
        "met": largest <= TARGET_RATIO,
    }
    write_json(args.json_output, report)
    for batch, row in report["summary"].items():
        cells = "  ".join(
            f"{m} {row['median_step_ms'][m]:7.1f} ms ({row['over_dense'][m]:.2f}x)" for m in MODES
        )
        print(f"batch {batch:>2}: {cells}")
    print(f"wrote {args.json_output}")
    return 0


if __name__ == "__main__":
    reexec_with_openblas()  # Debian's OpenBLAS where installed; the runs inherit it
    sys.exit(startup.run(main))

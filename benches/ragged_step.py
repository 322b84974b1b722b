"""3.4/4.3: the time of one decode step with B requests, by how the pass reads the KV cache,
and where that time goes.

Four ways, each (mode, batch) in a fresh process, the modes alternating:

- dense:       the alternate policy's batched decode over dense caches (3.1's BatchingKvCache);
- per-segment: the hybrid pass over a pool read in place, each segment writing its keys/values
               and attending on its own (the order of 3.4's first version, which makes MLX copy
               a layer's pool for every write after a read);
- one-write:   the hybrid pass as it is: every segment's keys/values in one scatter per layer,
               then one paged_attention call per segment length (all decode rows in one);
- mlx-lm:      mlx-lm's Qwen3 on the same weights over its BatchKVCache, one batched forward and
               an argmax per step (what its BatchGenerator runs), as the outside yardstick.

Each process prefills B requests of --context prompt tokens, then times --steps decode steps,
split into three parts: the Python that builds the step's graph (the model's forward call, which
only records operations), the wait for MLX to compute it (the sampler's read of the tokens), and
the rest of the step on the host (scheduling, bookkeeping, detokenizing, stop strings). The
linear layers of the step (every projection, the MLP and the LM head on B rows, timed alone on
the same weights) are split off the computing part; what is left there is the KV write and
attention, the part the modes differ in. It also reports the peak memory of the run.

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
MODES = ("dense", "per-segment", "one-write", "mlx-lm")
PARTS = ("graph", "compute", "host")  # a step's wall time, as split by Timers
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


class Timers:
    """Wall time spent inside wrapped functions, by part, over the timed steps."""

    def __init__(self) -> None:
        self.seconds = {part: 0.0 for part in PARTS}
        self.on = False

    def wrap(self, part: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[part] += time.perf_counter() - start

        return timed


def measure(directory: str, mode: str, batch: int, args: argparse.Namespace) -> dict:
    """In this (fresh) process: the decode step times of one mode at one batch size, and
    their split into parts (each part's mean per step, in ms)."""
    import mlx.core as mx

    from tiny_llm_support import load_checkpoint

    ckpt = load_checkpoint(directory, dtype="float32")
    timers = Timers()
    step = (mlx_lm_stepper if mode == "mlx-lm" else engine_stepper)(ckpt, mode, batch, args, timers)
    step()  # one decode step before timing
    times = []
    timers.on = True
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    timers.on = False
    parts = {part: 1000 * s / args.steps for part, s in timers.seconds.items()}
    parts["host"] = 1000 * sum(times) / args.steps - parts["graph"] - parts["compute"]
    parts["linear"] = linear_ms(ckpt, batch)
    parts["kv"] = parts["compute"] - parts["linear"]  # the KV write and attention, and the rest
    return {"step_ms": summarize(times, 1000), "mean_parts_ms": parts,
            "peak_bytes": mx.get_peak_memory()}  # fmt: skip


def engine_prompt(i: int, length: int) -> list[int]:
    """Ordinary ids of the tiny tokenizer (10..509), a prompt of its own per request."""
    return [(7 * i + 13 * j) % 500 + 10 for j in range(length)]


def engine_stepper(ckpt, mode: str, batch: int, args: argparse.Namespace, timers: Timers):
    """The reference Engine with B requests prefilled: a function that runs one engine step.
    The model's forward calls count as "graph", the samplers' reads of the tokens as
    "compute"."""
    import tiny_llm_ref as ref
    from tiny_llm_ref import scheduler, stall_free

    if mode == "per-segment":  # every cache attends on its own: the first version's order
        ref.TinyKvPagedCache.pages_in_place = property(lambda self: False)
    stall_free.forward_ragged = timers.wrap("graph", stall_free.forward_ragged)
    ref.Qwen3Model.__call__ = timers.wrap("graph", ref.Qwen3Model.__call__)
    for module in (stall_free, scheduler):
        module.pick_tokens = timers.wrap("compute", module.pick_tokens)
    longest = args.context + args.steps + 16
    model = ref.Qwen3Model(ckpt, max_seq_len=longest)
    pools = None if mode == "dense" else model.create_kv_pools(16, read_in_place=True)
    engine = ref.Engine(
        model, ckpt.tokenizer, max_seq_len=longest, batch_size=batch, prefill_step=256,
        pools=pools, policy="alternate" if mode == "dense" else "hybrid",
    )  # fmt: skip
    for i in range(batch):
        params = ref.SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
        engine.add_request(engine_prompt(i, args.context), params)
    slots = engine.scheduler.slots
    while None in slots or not all(r.is_prefill_done for r in slots):
        engine.step()
    return engine.step


def mlx_lm_stepper(ckpt, mode: str, batch: int, args: argparse.Namespace, timers: Timers):
    """mlx-lm's Qwen3 over BatchKVCache with the same B prompts prefilled together: a function
    that runs one greedy decode step (forward call: "graph"; reading the tokens: "compute")."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from tiny_llm_support import mlx_lm_qwen3

    model = mlx_lm_qwen3(ckpt)
    cache = [BatchKVCache([0] * batch) for _ in model.layers]
    prompts = mx.array([engine_prompt(i, args.context) for i in range(batch)])  # [B, C]
    tokens = [mx.argmax(model(prompts, cache=cache)[:, -1, :], axis=-1).tolist()]
    forward = timers.wrap("graph", lambda y: model(y, cache=cache))
    read = timers.wrap("compute", lambda logits: mx.argmax(logits[:, -1, :], axis=-1).tolist())

    def step() -> None:
        tokens[0] = read(forward(mx.array(tokens[0])[:, None]))  # [B, 1] -> [B, 1, V] -> [B]

    return step


def linear_ms(ckpt, batch: int, repeats: int = 5) -> float:
    """The median time of every linear layer of one decode step on `batch` rows: each layer's
    projections and MLP, and the LM head, on random rows, evaluated together."""
    import mlx.core as mx

    names = [n for n, w in ckpt.weights.items() if n.endswith("proj.weight") and w.ndim == 2]
    head = "lm_head.weight" if "lm_head.weight" in ckpt.weights else "model.embed_tokens.weight"
    weights = [ckpt.weights[n] for n in [*names, head]]
    rows = [mx.random.normal((batch, w.shape[1])) for w in weights]
    mx.eval(rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([x @ w.T for x, w in zip(rows, weights)])
        times.append(time.perf_counter() - start)
    return 1000 * median(times)


def run_fresh(directory: Path, mode: str, batch: int, argv: list[str]) -> dict:
    """measure() in a process of its own; its last line of output is the record."""
    command = [sys.executable, __file__, *argv, "--child", str(directory), mode, str(batch)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} at batch {batch} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict], batches: list[int]) -> dict:
    """Per batch: each mode's median step (over repeats: the median of their medians), its
    ratio over dense, and its parts (the median over repeats of each part's mean)."""
    out = {}
    for batch in batches:
        medians, parts = {}, {}
        for mode in MODES:
            mine = [r for r in runs if (r["mode"], r["batch"]) == (mode, batch)]
            medians[mode] = median([r["step_ms"]["median"] for r in mine])
            names = mine[0]["mean_parts_ms"]
            parts[mode] = {n: median([r["mean_parts_ms"][n] for r in mine]) for n in names}
        ratios = {m: medians[m] / medians["dense"] for m in MODES}
        out[str(batch)] = {"median_step_ms": medians, "over_dense": ratios, "parts_ms": parts}
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
        for mode in MODES:
            parts = "  ".join(f"{n} {v:6.1f}" for n, v in row["parts_ms"][mode].items())
            step = f"{row['median_step_ms'][mode]:7.1f} ms ({row['over_dense'][mode]:.2f}x)"
            print(f"batch {batch:>2} {mode:<11} {step}   {parts}")
    print(f"wrote {args.json_output}")
    return 0


if __name__ == "__main__":
    reexec_with_openblas()  # Debian's OpenBLAS where installed; the runs inherit it
    sys.exit(startup.run(main))

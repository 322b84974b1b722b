"""3.4/4.3: one decode step of B requests, by how the pass reads the KV cache, and where its time
goes; each (mode, batch) in a fresh process, the modes in turn. dense: the alternate policy over
3.1's dense caches; per-segment: the hybrid pass over pages, each segment writing then attending
(3.4's first order: MLX copies a layer's pool for every write after a read); one-write: the
hybrid pass as it is (one scatter per layer, then paged_attention); mlx-lm: its Qwen3 over
BatchKVCache. Each prefills B prompts of --context tokens, then times --steps decode steps, split
into graph (the forward call), compute (the wait for the tokens: "linear", the step's linear
layers timed alone, and "kv", the rest) and host (the rest of the step); and the peak memory.

    pdm run bench-ragged-step [--model qwen3-0.6b] [--num-layers 8] [--batches 1 4 8]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches import harness
from benches.ceilings import timed
from benches.serving_load import write_model
from tiny_llm_support import load_checkpoint, mlx_lm_qwen3
from tiny_llm_support.cli import int_at_least

MODES = ("dense", "per-segment", "one-write", "mlx-lm")
PARTS = ("graph", "compute", "host")  # a step's wall time, as split by Timers
TARGET_RATIO = 1.15  # issue 41: one-write at batch 8 within 1.15x of dense


class Timers:
    """Wall time spent inside wrapped functions, by part, while `on`."""

    def __init__(self) -> None:
        self.seconds, self.on = dict.fromkeys(PARTS, 0.0), False

    def wrap(self, part: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[part] += time.perf_counter() - start

        return timed


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one mode's decode steps at one batch size, and their parts (each
    part's mean per step, in ms)."""
    ckpt = load_checkpoint(spec["directory"], dtype="float32")
    timers, steps, batch = Timers(), spec["steps"], spec["batch"]
    stepper = mlx_lm_stepper if spec["mode"] == "mlx-lm" else engine_stepper
    step = stepper(ckpt, spec["mode"], batch, spec["context"], steps, timers)
    step()  # one decode step before timing
    times, timers.on = [], True
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    timers.on = False
    parts = {part: 1000 * s / steps for part, s in timers.seconds.items()}
    parts["host"] = 1000 * sum(times) / steps - parts["graph"] - parts["compute"]
    parts["linear"] = linear_ms(ckpt, batch)
    parts["kv"] = parts["compute"] - parts["linear"]  # the KV write and attention, and the rest
    return {"mode": spec["mode"], "batch": batch, "step_ms": harness.summarize(times, 1000),
            "mean_parts_ms": parts, "peak_bytes": mx.get_peak_memory()}  # fmt: skip


def engine_prompt(i: int, length: int) -> list[int]:
    """Ordinary ids of the tiny tokenizer (10..509), a prompt of its own per request."""
    return [(7 * i + 13 * j) % 500 + 10 for j in range(length)]


def engine_stepper(ckpt, mode: str, batch: int, context: int, steps: int, timers: Timers):
    """One engine step of the reference Engine with B requests prefilled; the model's forward
    calls count as "graph", the samplers' reads of the tokens as "compute"."""
    import tiny_llm_ref as ref
    from tiny_llm_ref import scheduler, stall_free

    if mode == "per-segment":  # every cache attends on its own: the first version's order
        ref.TinyKvPagedCache.pages_in_place = property(lambda self: False)
    stall_free.forward_ragged = timers.wrap("graph", stall_free.forward_ragged)
    ref.Qwen3Model.__call__ = timers.wrap("graph", ref.Qwen3Model.__call__)
    for module in (stall_free, scheduler):
        module.pick_tokens = timers.wrap("compute", module.pick_tokens)
    longest = context + steps + 16
    model = ref.Qwen3Model(ckpt, max_seq_len=longest)
    pools = None if mode == "dense" else model.create_kv_pools(16, read_in_place=True)
    engine = ref.Engine(
        model, ckpt.tokenizer, max_seq_len=longest, batch_size=batch, prefill_step=256,
        pools=pools, policy="alternate" if mode == "dense" else "hybrid",
    )  # fmt: skip
    for i in range(batch):
        params = ref.SamplingParams(max_tokens=steps + 8, ignore_eos=True)
        engine.add_request(engine_prompt(i, context), params)
    slots = engine.scheduler.slots
    while None in slots or not all(r.is_prefill_done for r in slots):
        engine.step()
    return engine.step


def mlx_lm_stepper(ckpt, mode: str, batch: int, context: int, steps: int, timers: Timers):
    """One greedy decode step of mlx-lm's Qwen3 over BatchKVCache, the B prompts prefilled
    together (forward call: "graph"; reading the tokens: "compute")."""
    from mlx_lm.models.cache import BatchKVCache

    model = mlx_lm_qwen3(ckpt)
    cache = [BatchKVCache([0] * batch) for _ in model.layers]
    prompts = mx.array([engine_prompt(i, context) for i in range(batch)])  # [B, C]
    tokens = [mx.argmax(model(prompts, cache=cache)[:, -1, :], axis=-1).tolist()]
    forward = timers.wrap("graph", lambda y: model(y, cache=cache))
    read = timers.wrap("compute", lambda logits: mx.argmax(logits[:, -1, :], axis=-1).tolist())

    def step() -> None:
        tokens[0] = read(forward(mx.array(tokens[0])[:, None]))  # [B, 1] -> [B, 1, V] -> [B]

    return step


def linear_ms(ckpt, batch: int, repeats: int = 5) -> float:
    """The median time of every linear layer of one decode step on `batch` random rows: each
    layer's projections and MLP, and the LM head, evaluated together."""
    names = [n for n, w in ckpt.weights.items() if n.endswith("proj.weight") and w.ndim == 2]
    head = "lm_head.weight" if "lm_head.weight" in ckpt.weights else "model.embed_tokens.weight"
    weights = [ckpt.weights[n] for n in [*names, head]]
    rows = [mx.random.normal((batch, w.shape[1])) for w in weights]
    mx.eval(rows)
    step = lambda: [x @ w.T for x, w in zip(rows, weights)]
    return 1000 * harness.median(timed(step) for _ in range(repeats))


def main(argv=None) -> int:
    p = harness.bench_parser("bench-ragged-step", "One decode step of B requests, by how the "
                             "pass reads the KV cache, and where its time goes.")  # fmt: skip
    p.add_argument("--model", default="qwen3-0.6b", help="qwen3-0.6b (its shape) or tiny")
    p.add_argument("--num-layers", type=int_at_least(1), default=8, help="layers of the shape")
    p.add_argument("--batches", type=int_at_least(1), nargs="+", default=[1, 4, 8], help="requests")
    p.add_argument("--context", type=int_at_least(1), default=300, help="prompt tokens per request")
    p.add_argument("--steps", type=int_at_least(1), default=12, help="decode steps timed per run")
    p.add_argument("--repeats", type=int_at_least(1), default=1, help="runs of each (mode, batch)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    harness.add_output_arguments(p, "ragged-step-<model>-<host>.json")
    args = p.parse_args(argv)
    default = f"ragged-step-{args.model.lower()}-{harness.host_slug()}.json"
    harness.set_output_paths(p, args, harness.RESULTS / default)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-ragged-step-") as tmp:
        harness.log(f"writing the checkpoint ({args.model}, {args.num_layers} layers)")
        model = write_model(args, Path(tmp) / "model")
        run = {"directory": str(Path(tmp) / "model"), "context": args.context, "steps": args.steps}
        specs = [{"repeat": r, "batch": b, "mode": m, **run}
                 for r in range(args.repeats) for b in args.batches for m in MODES]  # fmt: skip
        label = lambda spec: f"{spec['mode']} at batch {spec['batch']}"
        line = lambda run: f"{label(run)}: {run['step_ms']['median']:.1f} ms a step"
        runs = harness.run_plan(__name__, specs, Path(tmp), dict(os.environ), label, line)
    model.pop("config", None)
    settings = {"model": model, "context": args.context, "steps": args.steps,
                "repeats": args.repeats, "batches": args.batches}  # fmt: skip
    summary = summarize(runs, args.batches)
    ratio = summary[str(max(args.batches))]["over_dense"]["one-write"]
    targets = {"one_write_over_dense_at_most": TARGET_RATIO, "batch": max(args.batches),
               "ratio": ratio, "met": ratio <= TARGET_RATIO}  # fmt: skip
    report = harness.report("ragged-step", started, settings, runs, summary, targets)
    harness.write_report(args, report, summary_table)
    return 0


def summarize(runs: list[dict], batches: list[int]) -> dict[str, Any]:
    """Per batch: each mode's median step (over repeats: the median of their medians), its
    ratio over dense, and its parts (the median over repeats of each part's mean)."""
    out = {}
    for batch in batches:
        medians, parts = {}, {}
        for mode in MODES:
            mine = [r for r in runs if (r["mode"], r["batch"]) == (mode, batch)]
            medians[mode] = harness.median(r["step_ms"]["median"] for r in mine)
            names = mine[0]["mean_parts_ms"]
            parts[mode] = {n: harness.median(r["mean_parts_ms"][n] for r in mine) for n in names}
        ratios = {m: medians[m] / medians["dense"] for m in MODES}
        out[str(batch)] = {"median_step_ms": medians, "over_dense": ratios, "parts_ms": parts}
    return out


def summary_table(report: dict[str, Any]) -> str:
    rows = [
        [batch, mode, f"{row['median_step_ms'][mode]:.1f}", f"{row['over_dense'][mode]:.2f}x",
         *(f"{v:.1f}" for v in row["parts_ms"][mode].values())]
        for batch, row in report["summary"].items() for mode in MODES
    ]  # fmt: skip
    parts = [f"{name} (ms)" for name in (*PARTS, "linear", "kv")]
    return harness.table(["batch", "mode", "step (ms)", "over dense", *parts], rows)

"""4.8: what a grammar costs the engine, every run in a fresh process (plan_runs' order).

- mask: a JSON document walked token by token through a `Grammar`: per token, the matcher's
  bitmask alone, and a row's cost (`Grammar.allowed`, then `mask_rows` on one row of logits),
  at the tiny tokenizer's vocabulary, padded to Qwen3's, and with a Qwen3-sized tokenizer
  (--big-tokenizer, else Qwen3-0.6B's if in the Hugging Face cache; nothing is downloaded).
- decode: the Engine's step with no row, one row or every row of a batch under a grammar that
  stays open, for each of --models. Target: every row within 1.10x of none, at the largest batch.

    pdm run bench-structured-output [--models tiny qwen3-0.6b] [--batches 1 4 8] [--steps 16]
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benches import harness
from benches.serving_load import DEFAULT_LAYERS, is_shape, write_model
from benches.serving_overhead import timed
from tiny_llm_support.cli import add_solution_argument, int_at_least, load_solution

TARGET_RATIO = 1.10  # the issue: a constrained row within 10% of a free one, at batch 8
QWEN3_VOCAB = 151936  # Qwen3's logits (its tokenizer has 151669 tokens; the rest is padding)
WARMUP_STEPS = 2
HOW_MANY = ("none", "one", "all")  # rows under the grammar in a decode run
STRING, AGE = {"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 150}
STATUS = {"enum": ["active", "inactive", "banned"]}


def record(properties: dict) -> dict:  # a JSON schema's object with exactly these properties
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}  # fmt: skip


# the mask runs walk this document of this schema: the kind of object an agent asks for
DOCUMENT_SCHEMA = record({
    "name": STRING, "age": AGE, "score": {"type": "number", "minimum": 0, "maximum": 1},
    "status": STATUS, "tags": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 5},
    "address": record({"city": STRING, "zip": STRING}),
})  # fmt: skip
DOCUMENT = {
    "name": 'Dr. Alice "Al" Smith-Jones, née Müller; born 1979 in Zürich (CH)', "age": 42,
    "score": 0.75, "status": "inactive", "tags": ["alpha", "beta gamma", "δέλτα", "x_y-z 123"],
    "address": {"city": "Saint-Rémy-de-Provence", "zip": "13210"},
}  # fmt: skip
# the decode runs' constrained rows write at least 512 records with bounded strings: the
# grammar stays open (no EOS) for every timed step, and the rows go through keys, strings,
# numbers and enums in turn
DECODE_SCHEMA = {"type": "array", "minItems": 512, "items": record({
    "name": {"type": "string", "maxLength": 16}, "age": AGE, "status": STATUS,
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
})}  # fmt: skip


def compile_schema(schema: dict) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    record = measure_mask(spec) if spec["part"] == "mask" else measure_decode(spec)
    return {**record, "blas": harness.process_blas()}


def measure_mask(spec: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    from tiny_llm_support import load_tokenizer

    api, tokenizer = load_solution(spec["solution"]), load_tokenizer(spec["tokenizer"])
    grammar = api.Grammar(tokenizer, compile_schema(DOCUMENT_SCHEMA), spec["vocab"])
    text = json.dumps(DOCUMENT, ensure_ascii=False, separators=(",", ":"))
    ids = [*tokenizer.encode(text), tokenizer.eos_token_id]
    logits = mx.random.normal((1, spec["vocab"]), key=mx.random.key(0))
    mx.eval(logits)
    times: dict[str, list[float]] = {"matcher": [], "allowed": [], "mask_rows": [], "row": []}
    for walk in range(2 * spec["walks"] + 1):  # 0 warms up, then odd: the matcher, even: a row
        grammar.matcher.reset()
        for token in ids:
            start = time.perf_counter()
            if walk % 2:
                grammar.matcher.compute_bitmask()
                times["matcher"].append(time.perf_counter() - start)
            else:
                allowed = grammar.allowed()
                middle = time.perf_counter()
                mx.eval(api.mask_rows(logits, [allowed]))
                end = time.perf_counter()
                if walk > 0:
                    times["allowed"].append(middle - start)
                    times["mask_rows"].append(end - middle)
                    times["row"].append(end - start)
            grammar.advance(token)
    return {"part": "mask", "label": spec["label"], "vocab": spec["vocab"], "tokens": len(ids),
            "tokenizer_vocab": tokenizer.vocab_size,
            **{f"{part}_us": harness.summarize(v, 1e6) for part, v in times.items()}}  # fmt: skip


def measure_decode(spec: dict[str, Any]) -> dict[str, Any]:
    from tiny_llm_support import load_checkpoint

    api = load_solution(spec["solution"])
    sampler = importlib.import_module(f"{api.__name__}.sampler")
    ckpt = load_checkpoint(spec["directory"], dtype="float32")
    batch, steps, constrained = spec["batch"], spec["steps"], spec["constrained"]
    longest = spec["context"] + WARMUP_STEPS + steps + 16
    model = api.Qwen3Model(ckpt, max_seq_len=longest)
    engine = api.Engine(
        model, ckpt.tokenizer, max_seq_len=longest, batch_size=batch, prefill_step=256,
        pools=model.create_kv_pools(16, read_in_place=True), policy="hybrid",
    )  # fmt: skip
    grammar = compile_schema(DECODE_SCHEMA)
    for i in range(batch):  # ordinary ids of the tiny tokenizer (10..509), a prompt each
        ids = [(7 * i + 13 * j) % 500 + 10 for j in range(spec["context"])]
        engine.add_request(ids, api.SamplingParams(max_tokens=longest, ignore_eos=True,
                           grammar=grammar if i < constrained else None))  # fmt: skip
    text, slots = [], engine.scheduler.slots  # the first request's (constrained, but at none)

    def step() -> list:
        outputs = engine.step()
        text.extend(out.text for out in outputs if out.request_id == 0)
        return outputs

    while None in slots or not all(r.is_prefill_done for r in slots):
        step()
    for _ in range(WARMUP_STEPS):
        step()
    masking = timed(sampler, "constrain", [0.0], per_call=False)  # building the masks, on the host
    times, tokens = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        outputs = step()
        times.append(time.perf_counter() - start)
        tokens += sum(len(out.token_ids) for out in outputs)
    if tokens != batch * steps:
        raise RuntimeError(f"{tokens} tokens in {steps} steps of {batch} rows: a row ended")
    return {"part": "decode", "model": spec["model"], "batch": batch, "how": spec["how"],
            "constrained": constrained, "step_ms": harness.summarize(times, 1000),
            "tokens_per_s": tokens / sum(times), "constrain_ms_per_step": 1000 * masking[0] / steps,
            "first_row_text": "".join(text)[:200]}  # fmt: skip


def big_tokenizer(path: Path | None) -> tuple[Path | None, str]:
    """The directory of a Qwen3-sized tokenizer and where it came from, or (None, why not)."""
    if path is not None:
        return (path.parent if path.name == "tokenizer.json" else path), "--big-tokenizer"
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache("Qwen/Qwen3-0.6B", "tokenizer.json")
    except Exception:  # any failure means: not in the cache
        found = None
    if not isinstance(found, str):
        return None, "Qwen/Qwen3-0.6B's tokenizer is not in the Hugging Face cache"
    return Path(found).parent, "Qwen/Qwen3-0.6B (Hugging Face cache)"


def main(argv=None) -> int:
    p = harness.bench_parser("bench-structured-output", "What a grammar mask costs per token "
                             "and per decode step (chapter 4.8).")  # fmt: skip
    p.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.6b"],
                   help="tiny (the shipped chat model) and/or qwen3-0.6b (its shape)")  # fmt: skip
    p.add_argument("--num-layers", type=int_at_least(1), default=DEFAULT_LAYERS, help="of a shape")
    p.add_argument("--batches", type=int_at_least(1), nargs="+", default=[1, 4, 8])
    p.add_argument("--context", type=int_at_least(1), default=64, help="prompt tokens a request")
    p.add_argument("--steps", type=int_at_least(1), default=16, help="decode steps timed a run")
    p.add_argument("--walks", type=int_at_least(1), default=10, help="walks of each kind a run")
    p.add_argument("--big-tokenizer", type=Path, help="a Qwen3-sized tokenizer (dir or file)")
    p.add_argument("--repeats", type=int_at_least(1), default=1, help="runs of each setting")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    add_solution_argument(p)
    harness.add_output_arguments(p, "structured-output-<models>-<host>.json")
    args = p.parse_args(argv)
    if bad := [m for m in args.models if m != "tiny" and not is_shape(m)]:
        p.error(f"--models {bad[0]}: use tiny or a shape ({', '.join(harness.EMBEDDED_CONFIGS)})")
    labels = [m if m == "tiny" else f"{m}-{args.num_layers}layers" for m in args.models]
    default = f"structured-output-{'-'.join(labels)}-{harness.host_slug()}.json"
    harness.set_output_paths(p, args, harness.RESULTS / default)
    big, big_source = big_tokenizer(args.big_tokenizer)
    if big is not None and not (big / "tokenizer.json").is_file():
        p.error(f"--big-tokenizer {args.big_tokenizer}: no tokenizer.json there")
    from tiny_llm_support.models import tiny_chat_dir

    tiny = tiny_chat_dir()
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    masks = {"tiny": (tiny, vocab), "tiny-padded": (tiny, QWEN3_VOCAB)}
    masks |= {} if big is None else {"big": (big, QWEN3_VOCAB)}
    tokenizers = {name: {"path": str(d), "vocab": v, "source": big_source if name == "big" else
                         "the tiny chat model's", "sha256": hashlib.sha256(
                             (d / "tokenizer.json").read_bytes()).hexdigest()}
                  for name, (d, v) in masks.items()}  # fmt: skip
    started, models = time.time(), {}
    with tempfile.TemporaryDirectory(prefix="bench-structured-output-") as tmp:
        items = [{"part": "mask", "label": name, "tokenizer": str(d), "vocab": v,
                  "walks": args.walks} for name, (d, v) in masks.items()]  # fmt: skip
        for name in args.models:
            directory = Path(tmp) / name
            harness.log(f"writing the checkpoint ({name})")
            shape = SimpleNamespace(model=name, num_layers=args.num_layers, seed=args.seed)
            models[name] = {k: v for k, v in write_model(shape, directory).items() if k != "config"}
            for batch in args.batches:
                for how in HOW_MANY if batch > 1 else ("none", "all"):
                    items.append({"part": "decode", "model": name, "directory": str(directory),
                                  "batch": batch, "how": how, "steps": args.steps,
                                  "constrained": {"none": 0, "one": 1, "all": batch}[how],
                                  "context": args.context})  # fmt: skip
        specs = [{**item, "repeat": r, "order": order, "solution": args.solution}
                 for r, order, item in harness.plan_runs(items, args.repeats)]  # fmt: skip
        runs = harness.run_plan(__name__, specs, Path(tmp), dict(os.environ), label, run_line)
    summary = summarize(runs, args.models, args.batches)
    if big is None:
        summary["mask"]["big"] = {"available": False, "why": big_source}
    settings = {**harness.arguments_json(args, ("json_output", "big_tokenizer")),
                "models": models, "tokenizers": tokenizers, "decode_schema": DECODE_SCHEMA,
                "document_schema": DOCUMENT_SCHEMA, "document": DOCUMENT,
                "warmup_steps": WARMUP_STEPS, "policy": "hybrid", "page_size": 16}  # fmt: skip
    report = harness.report("structured-output", started, settings, runs, summary,
                            targets(summary, max(args.batches)))  # fmt: skip
    harness.write_report(args, report, summary_table)
    return 0


def label(spec: dict[str, Any]) -> str:
    if spec["part"] == "mask":
        return f"mask, {spec['label']} vocabulary"
    return f"decode {spec['model']}, batch {spec['batch']}, {spec['how']} constrained"


def run_line(run: dict[str, Any]) -> str:
    if run["part"] == "mask":
        row = run["row_us"]
        return f"mask {run['label']}: a row {row['median']:.0f} µs p50, {row['p95']:.0f} p95"
    return (f"decode {run['model']} batch {run['batch']} {run['how']}: "
            f"{run['step_ms']['median']:.1f} ms a step, {run['tokens_per_s']:.0f} tokens/s")  # fmt: skip


def summarize(runs: list[dict], models: list[str], batches: list[int]) -> dict[str, Any]:
    """The medians over repeats, per vocabulary and per (model, batch, rows constrained)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        key = (r["label"],) if r["part"] == "mask" else (r["model"], str(r["batch"]), r["how"])
        groups.setdefault(key, []).append(r)
    mask, decode = {}, {m: {str(b): {} for b in batches} for m in models}
    for key, mine in groups.items():
        first = mine[0]
        if len(key) == 1:
            mask[key[0]] = {"available": True, **{k: first[k] for k in ("vocab", "tokens",
                            "tokenizer_vocab")}, **{k: {q: harness.median(r[k][q] for r in mine)
                            for q in ("median", "p95")} for k in first if k.endswith("_us")}}  # fmt: skip
        else:
            decode[key[0]][key[1]][key[2]] = {
                "step_ms": harness.median(r["step_ms"]["median"] for r in mine),
                **{k: harness.median(r[k] for r in mine)
                   for k in ("tokens_per_s", "constrain_ms_per_step")}}  # fmt: skip
    for rows in (rows for by_batch in decode.values() for rows in by_batch.values()):
        for how in ("one", "all"):
            if how in rows:
                rows[f"{how}_over_none"] = rows[how]["step_ms"] / rows["none"]["step_ms"]
    return {"mask": mask, "decode": decode}


def targets(summary: dict[str, Any], batch: int) -> dict[str, Any]:
    ratios = {m: rows[str(batch)]["all_over_none"] for m, rows in summary["decode"].items()}
    return {"all_over_none_at_most": TARGET_RATIO, "batch": batch, "ratios": ratios,
            "met_by_model": {m: r <= TARGET_RATIO for m, r in ratios.items()},
            "met": all(r <= TARGET_RATIO for r in ratios.values())}  # fmt: skip


def summary_table(report: dict[str, Any]) -> str:
    parts, qs = ("matcher", "allowed", "mask_rows", "row"), ("median", "p95")
    head = ["vocabulary", "logits", *(f"{p} {q} (µs)" for p in parts for q in ("p50", "p95"))]
    masks = [[name, str(row["vocab"]), *(f"{row[f'{part}_us'][q]:.0f}" for part in parts for q in qs)]
             for name, row in report["summary"]["mask"].items() if row["available"]]  # fmt: skip
    decode = [
        [model, batch, how, f"{rows[how]['step_ms']:.1f}", f"{rows[how]['tokens_per_s']:.0f}",
         f"{rows[how]['constrain_ms_per_step']:.2f}", f"{rows.get(f'{how}_over_none', 1):.3f}"]
        for model, batches in report["summary"]["decode"].items()
        for batch, rows in batches.items() for how in HOW_MANY if how in rows
    ]  # fmt: skip
    t = report["targets"]
    ratios = ", ".join(f"{m} {r:.3f}x" for m, r in t["ratios"].items())
    goal = (f"target: every row constrained at batch {t['batch']} within "
            f"{t['all_over_none_at_most']}x of none: {harness.met(t['met'])} ({ratios})")  # fmt: skip
    head2 = ["model", "batch", "constrained", "step (ms)", "tokens/s", "masks (ms)", "over none"]
    return "\n".join([harness.table(head, masks), harness.table(head2, decode), goal])

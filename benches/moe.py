"""Week 4 Day 6: a mixture of experts three ways on a Qwen3-30B-A3B-shaped sparse layer (the shape
flags change it; --layers of them, random float32 weights): loop (Qwen3SparseMoE, grouped=False),
grouped (gather_mm over the pairs sorted by expert), mlx-lm's SwitchGLU and, with --own-kernel
(chapter 5.3), own-kernel, on the same weights. Part "block": layer 0's block alone, a prefill and
one decode step of each --decode-batches rows; part "model": the whole model, a prefill and
--decode-steps steps. Every output is checked against grouped's, then the variants take turns:
medians, and the bytes a call reads against the machine's ceilings (benches/ceilings.py).

    OPENBLAS_CORETYPE=SkylakeX pdm run bench-moe    # 1 layer, minutes (--help: the shape flags)
"""

import math
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benches import harness
from benches.ceilings import measure_ceilings
from benches.model_impls import MlxLmImpl, RefImpl
from benches.moe_own_kernel import OWN_KERNEL, kernel_breakdown, own_kernel_moe
from tiny_llm_support import Checkpoint, Qwen3Config, choose_device, expected_shapes, random_weights
from tiny_llm_support.cli import add_solution_argument, int_at_least, load_solution

# Qwen3-30B-A3B's published config.json (48 layers; --layers keeps the first few)
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "vocab_size": 151936, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
SHAPE_FLAGS = {"experts": "num_experts", "experts_per_token": "num_experts_per_tok",
               "hidden": "hidden_size", "expert_width": "moe_intermediate_size",
               "vocab": "vocab_size"}  # fmt: skip
FIRST_CONTROL_ID = 151643  # Qwen3's ids from here up are control tokens: prompts stay below
VARIANTS = ("loop", "grouped", "mlx-lm")
DTYPE = mx.float32  # the CPU's dtype: bf16 matmul is slow there, and gather_mm is fp32-only
SLOW_S = 1.5  # a first run longer than this counts as a sample: it gains nothing from a warm-up
AGREEMENT_RTOL = 1e-3  # max |variant - grouped| / max |grouped|, at most
TARGET_GROUPED_OVER_LOOP = 3.0  # block prefill: loop's time / grouped's time, at least
TARGET_GROUPED_OVER_MLX_LM = 1.25  # every block row: grouped's time / mlx-lm's time, at most
TARGET_OWN_OVER_LOOP = 3.0  # block prefill: loop's time / own-kernel's time, at least
TARGET_OWN_OVER_GROUPED_DECODE = 1.0  # block decode rows: own-kernel's / grouped's, at most
TARGET_LINES = {  # what the table says of each target
    "grouped_speedup_over_loop_prefill":
        "grouped at least {target_at_least}x faster than loop at {case}: {value:.2f}x, {met}",
    "grouped_time_over_mlx_lm":
        "grouped within {target_at_most}x of mlx-lm's time: {values}: {met}",
    "own_kernel_speedup_over_loop_prefill":
        "own-kernel at least {target_at_least}x faster than loop at {case}: {value:.2f}x, {met}",
    "own_kernel_time_over_grouped_decode":
        "own-kernel's decode time at most {target_at_most}x grouped's: {values}: {met}",
}  # fmt: skip


def variants(args) -> tuple[str, ...]:
    return VARIANTS + ((OWN_KERNEL,) if args.own_kernel else ())


class Disagreement(RuntimeError):
    """A variant's output differs from grouped's by more than AGREEMENT_RTOL."""


def expert_bytes(c: Qwen3Config) -> int:
    """One expert's gate, up and down matrices."""
    return 3 * c.moe_intermediate_size * c.hidden_size * DTYPE.size


def block_cost(c: Qwen3Config, x: mx.array, w_router: mx.array) -> dict[str, int]:
    """What one sparse block reads and computes on x [..., H]: the router and each expert some
    token chose (bytes), 2 FLOPs per multiply-add of the router and of k experts per token."""
    flat, k = x.reshape(-1, c.hidden_size), c.num_experts_per_tok  # [N, H]
    logits = flat @ w_router.T  # [N, E]: the top k of the logits are the top k of the softmax
    touched = len(np.unique(np.array(mx.argpartition(-logits, kth=k - 1, axis=-1))[:, :k]))
    per_token = (c.num_experts + 3 * k * c.moe_intermediate_size) * c.hidden_size  # multiply-adds
    return {"experts_touched": touched, "weight_bytes": w_router.nbytes + touched * expert_bytes(c),
            "flops": 2 * flat.shape[0] * per_token}  # fmt: skip


def decode_step_bytes(c: Qwen3Config, context: int) -> dict[str, int]:
    """What one decode step of one row reads, by part, over `context` cached positions."""
    size, layers = DTYPE.size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
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


def sample(calls: dict[str, Callable], repeats: int, where: str) -> tuple[dict, list]:
    """Every variant's samples (a call returns its times and its output) and the agreement checks
    of their first outputs with grouped's. Each call runs once first (a sample only if it took
    over SLOW_S); then the variants take turns in plan_runs' order until each has `repeats`."""
    samples, outputs = {}, {}
    for name, call in calls.items():
        start = time.perf_counter()
        times, outputs[name] = call()
        samples[name] = [times] if time.perf_counter() - start > SLOW_S else []
    others = [name for name in calls if name != "grouped"]
    checks = [agreement(where, name, outputs[name], outputs["grouped"]) for name in others]
    for r, _, name in harness.plan_runs(list(calls), repeats):
        if len(samples[name]) < repeats:
            start = time.perf_counter()
            samples[name].append(calls[name]()[0])
            harness.log(f"  {where}, {name} {r + 1}/{repeats}: {time.perf_counter() - start:.2f} s")
    return samples, checks


def agreement(where: str, name: str, output: mx.array, grouped: mx.array) -> dict[str, Any]:
    """The check of a variant's output against grouped's: the largest difference, relative to
    grouped's largest value. Over AGREEMENT_RTOL: a Disagreement."""
    scale = mx.abs(grouped).max().item()
    diff = mx.abs(output.astype(mx.float32) - grouped).max().item()
    relative = diff / scale if scale else diff
    harness.log(f"  agreement {where}: {name} vs grouped, relative {relative:.1e}")
    if relative > AGREEMENT_RTOL:
        raise Disagreement(f"{where}: {name} differs from grouped by {diff:.3e} (relative "
                           f"{relative:.3e}, more than {AGREEMENT_RTOL})")  # fmt: skip
    return {"where": where, "variant": name, "max_abs_diff": diff, "max_abs_grouped": scale,
            "relative_diff": relative, "ok": True}  # fmt: skip


def bench_block(pkg, ckpt: Checkpoint, mlx_lm, args, ceilings) -> tuple[list, list, dict]:
    """Rows (case, variant) of layer 0's block alone, x [B, L, H] -> [B, L, H]; the checks; with
    --own-kernel, where own-kernel's prefill time goes (kernel_breakdown)."""
    c, w, p = ckpt.config, ckpt.weights, "model.layers.0.mlp."
    experts = [w[f"{p}switch_mlp.{name}_proj.weight"] for name in ("gate", "up", "down")]
    moe = (c.num_experts_per_tok, c.norm_topk_prob, w[p + "gate.weight"], *experts)
    blocks = {"loop": pkg.Qwen3SparseMoE(*moe), "grouped": pkg.Qwen3SparseMoE(*moe)}
    blocks["loop"].grouped, blocks["grouped"].grouped = False, True
    blocks["mlx-lm"] = mlx_lm.model.model.layers[0].mlp
    if OWN_KERNEL in variants(args):
        blocks[OWN_KERNEL] = own_kernel_moe(pkg.Qwen3SparseMoE(*moe))
    cases = [("prefill", 1, args.prefill)] + [("decode", b, 1) for b in args.decode_batches]
    rows, checks, breakdown = [], [], {}
    for case, batch, length in cases:
        label, tokens = f"{case} {batch}x{length}", batch * length  # rows x tokens per row
        key = mx.random.key(args.seed + tokens)
        x = mx.random.normal((batch, length, c.hidden_size), key=key).astype(DTYPE)
        calls = {name: partial(timed_block, block, x) for name, block in blocks.items()}
        samples, found = sample(calls, args.repeats, f"block {label}")
        checks += found
        cost = block_cost(c, x, w[p + "gate.weight"])
        for name in blocks:
            times = [s["s"] for s in samples[name]]
            t = harness.median(times)
            gb_per_s, gflop_per_s = cost["weight_bytes"] / t / 1e9, cost["flops"] / t / 1e9
            rows.append({"part": "block", "label": label, "case": case, "batch": batch,
                         "tokens": tokens, "variant": name, "samples_s": times, "median_s": t,
                         "ms_per_token": t * 1000 / tokens, "tokens_per_s": tokens / t, **cost,
                         "gb_per_s": gb_per_s,
                         "share_of_bandwidth": gb_per_s / ceilings["bandwidth_ceiling_gbs"],
                         "gflop_per_s": gflop_per_s,
                         "share_of_matmul": gflop_per_s / ceilings["matmul_ceiling_gflops"],
                         })  # fmt: skip
        if case == "prefill" and OWN_KERNEL in blocks:
            own_s = harness.median([s["s"] for s in samples[OWN_KERNEL]])
            breakdown = kernel_breakdown(pkg, blocks[OWN_KERNEL], x, args.repeats, own_s)
    return rows, checks, breakdown


def timed_block(block: Callable[[mx.array], mx.array], x: mx.array):
    """One call of a block: its seconds, and its output."""
    start = time.perf_counter()
    y = block(x)
    mx.eval(y)
    return {"s": time.perf_counter() - start}, y


def generate(impl, prompt: mx.array, steps: mx.array):
    """A prefill of prompt [1, T], then one decode step per token of steps [1, S] (the same
    tokens for every variant, whatever the logits say), through a model_impls implementation:
    the prefill's seconds and the median step's; the prefill's and the last step's logits."""
    start = time.perf_counter()
    first, cache = impl.prefill(prompt)  # [1, 1, V]
    mx.eval(first)
    prefill_s, step_s, last, offset = time.perf_counter() - start, [], first, prompt.shape[1]
    for i in range(steps.shape[1]):
        start = time.perf_counter()
        last, offset = impl.decode_step(steps[:, i : i + 1], cache, offset)
        mx.eval(last)
        step_s.append(time.perf_counter() - start)
    out = mx.concatenate([first.reshape(-1), last.reshape(-1)])
    return {"prefill_s": prefill_s, "decode_step_s": harness.median(step_s)}, out


def bench_model(pkg, ckpt: Checkpoint, mlx_lm, args, ceilings) -> tuple[list, list]:
    """Rows per variant of the whole model, and the agreement checks."""
    runs: dict[str, Any] = {}
    for name in variants(args):  # the same weight arrays, one path each
        if name == "mlx-lm":
            runs[name] = mlx_lm
            continue
        runs[name] = RefImpl(pkg, ckpt, "dense")
        for layer in runs[name].model.layers:
            layer.mlp.grouped = name != "loop"  # own-kernel: grouped, through the kernel
            if name == OWN_KERNEL:
                own_kernel_moe(layer.mlp)
    high = min(ckpt.config.vocab_size, FIRST_CONTROL_ID)
    ids = np.random.RandomState(args.seed).randint(0, high, args.prefill + args.decode_steps)
    prompt = mx.array(ids[None, : args.prefill], dtype=mx.int32)
    steps = mx.array(ids[None, args.prefill :], dtype=mx.int32)
    calls = {name: partial(generate, run, prompt, steps) for name, run in runs.items()}
    samples, checks = sample(calls, args.repeats, "model logits")
    context = args.prefill + (args.decode_steps + 1) // 2  # the middle of the timed steps
    step_bytes = decode_step_bytes(ckpt.config, context)
    rows = []
    for name in runs:
        prefill = [s["prefill_s"] for s in samples[name]]
        step = [s["decode_step_s"] for s in samples[name]]
        prefill_s, step_s = harness.median(prefill), harness.median(step)
        gb_per_s = step_bytes["total"] / step_s / 1e9
        rows.append({"part": "model", "variant": name, "prefill_tokens": args.prefill,
                     "decode_steps": args.decode_steps, "prefill_samples_s": prefill,
                     "prefill_s": prefill_s,
                     "prefill_ms_per_token": prefill_s * 1000 / args.prefill,
                     "decode_step_samples_s": step, "decode_ms_per_step": step_s * 1000,
                     "decode_context": context, "decode_bytes_per_step": step_bytes,
                     "decode_gb_per_s": gb_per_s,
                     "share_of_bandwidth": gb_per_s / ceilings["bandwidth_ceiling_gbs"],
                     })  # fmt: skip
    return rows, checks


def targets(block: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets on the block alone (own-kernel's with --own-kernel)."""
    if not block:
        return {"checked": False}
    at = {(r["label"], r["variant"]): r["median_s"] for r in block}
    prefill = block[0]["label"]
    labels = list(dict.fromkeys(r["label"] for r in block))

    def faster(name: str, low: float) -> dict[str, Any]:  # than the loop at prefill
        value = at[(prefill, "loop")] / at[(prefill, name)]
        return {"case": prefill, "value": value, "target_at_least": low, "met": value >= low}

    def within(name: str, other: str, cases: list[str], high: float) -> dict[str, Any]:
        values = {case: at[(case, name)] / at[(case, other)] for case in cases}
        return {"values": values, "target_at_most": high,
                "met": all(v <= high for v in values.values())}  # fmt: skip

    out = {"checked": True,
           "grouped_speedup_over_loop_prefill": faster("grouped", TARGET_GROUPED_OVER_LOOP),
           "grouped_time_over_mlx_lm": within("grouped", "mlx-lm", labels,
                                              TARGET_GROUPED_OVER_MLX_LM)}  # fmt: skip
    if (prefill, OWN_KERNEL) in at:  # Week 5 Day 3, with --own-kernel
        decode = [label for label in labels if label.startswith("decode")]
        out["own_kernel_speedup_over_loop_prefill"] = faster(OWN_KERNEL, TARGET_OWN_OVER_LOOP)
        bound = TARGET_OWN_OVER_GROUPED_DECODE
        out["own_kernel_time_over_grouped_decode"] = within(OWN_KERNEL, "grouped", decode, bound)
    return out


def summary_table(report: dict[str, Any]) -> str:
    rows = [("block", r["label"], r["variant"], f"{r['median_s'] * 1000:.1f}",
             f"{r['ms_per_token']:.2f}", str(r["experts_touched"]),
             f"{r['weight_bytes'] / 1e6:.1f}", f"{r['gb_per_s']:.2f}",
             f"{r['share_of_bandwidth']:.0%}")
            for r in report["runs"] if r["part"] == "block"]  # fmt: skip
    model = [r for r in report["runs"] if r["part"] == "model"]
    rows += [("model", f"prefill 1x{r['prefill_tokens']}", r["variant"],
              f"{r['prefill_s'] * 1000:.1f}", f"{r['prefill_ms_per_token']:.2f}", "", "", "", "")
             for r in model]  # fmt: skip
    rows += [("model", "decode 1x1", r["variant"], f"{r['decode_ms_per_step']:.1f}", "", "",
              f"{r['decode_bytes_per_step']['total'] / 1e6:.1f}", f"{r['decode_gb_per_s']:.2f}",
              f"{r['share_of_bandwidth']:.0%}") for r in model]  # fmt: skip
    c = report["summary"]["ceilings"]
    head = ("part", "case", "variant", "median ms", "ms/token", "experts", "weight MB", "GB/s",
            f"of {c['bandwidth_ceiling_gbs']:.1f} GB/s")  # fmt: skip
    lines = [harness.table(head, rows, "medians; weight MB: read at least per call")]
    for key, line in TARGET_LINES.items():
        if key in report["targets"]:
            t = report["targets"][key]
            values = ", ".join(f"{k} {v:.2f}x" for k, v in t.get("values", {}).items())
            line = line.format(**{**t, "values": values, "met": harness.met(t["met"])})
            lines.append(f"target: {line}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    what = "A mixture of experts three ways (a loop over experts, gather_mm, mlx-lm's SwitchGLU)"
    p = harness.bench_parser("bench-moe", f"{what}: the block alone and the model.")
    s = p.add_argument_group("shape (defaults: Qwen3-30B-A3B's)")
    s.add_argument("--layers", type=int_at_least(1), default=1, help="every one sparse")
    for flag, key in SHAPE_FLAGS.items():
        option, default = f"--{flag.replace('_', '-')}", QWEN3_30B_A3B[key]
        s.add_argument(option, type=int_at_least(1), default=default, help=key)
    r = p.add_argument_group("runs")
    r.add_argument("--parts", nargs="+", choices=("block", "model"), default=["block", "model"])
    r.add_argument("--prefill", type=int_at_least(1), default=512, help="prompt tokens")
    r.add_argument("--decode-batches", type=int_at_least(1), nargs="+", default=[1, 4],
                   help="block: rows of one decode step each")  # fmt: skip
    r.add_argument("--decode-steps", type=int_at_least(1), default=8, help="model")
    r.add_argument("--repeats", type=int_at_least(1), default=3, help="samples per variant")
    r.add_argument("--seed", type=int, default=0, help="weights, inputs and token ids")
    r.add_argument("--own-kernel", action="store_true",
                   help="add the own-kernel variant (Week 5 Day 3) and its JSON name")  # fmt: skip
    add_solution_argument(r)
    m = p.add_argument_group("machine")
    m.add_argument("--matmul-size", type=int_at_least(1), default=1024, help="ceilings: matmul")
    m.add_argument("--copy-mb", type=int_at_least(1), default=256, help="ceilings: copy size")
    m.add_argument("--no-openblas", action="store_true", help="keep the bundled BLAS (Linux)")
    harness.add_output_arguments(p, "moe-<shape>-<N>layers-<os>-<arch>-<N>cpu.json")
    args = p.parse_args(argv)
    if args.experts_per_token > args.experts:
        p.error(f"--experts-per-token {args.experts_per_token} is more than --experts")
    shape = {key: getattr(args, flag) for flag, key in SHAPE_FLAGS.items()}
    raw = {**QWEN3_30B_A3B, **shape, "num_hidden_layers": args.layers}
    config = Qwen3Config.from_dict(raw, source="bench-moe config")
    weights = sum(math.prod(s) for s in expected_shapes(config).values()) * DTYPE.size
    if weights > 0.75 * harness.memory_bytes():  # random_weights needs a float64 copy of one
        p.error(f"the weights need {weights / 1e9:.1f} GB, this machine has "
                f"{harness.memory_bytes() / 1e9:.1f} GB: use fewer --layers")  # fmt: skip
    default = all(QWEN3_30B_A3B[k] == v for k, v in shape.items())
    name = "qwen3-30b-a3b-shape" if default else "e{}-k{}-h{}-i{}-v{}".format(*shape.values())
    own = "-own-kernel" if args.own_kernel else ""
    name = f"moe-{name}-{args.layers}layers{own}-{harness.host_slug()}.json"
    harness.set_output_paths(p, args, harness.RESULTS / name)
    with harness.OneLineErrors(args.solution, Disagreement) as errors:
        report = run(load_solution(args.solution), args, config)
        harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return errors.status


def run(pkg, args, config: Qwen3Config) -> dict[str, Any]:
    started, device = time.time(), choose_device("cpu")
    load = os.getloadavg()  # 1, 5 and 15 minutes, as the run started
    core = harness.log_blas()
    harness.log(f"machine limits (matmul {args.matmul_size}, copy {args.copy_mb} MB):")
    ceilings = measure_ceilings(args.matmul_size, args.copy_mb, 3, DTYPE)
    t = time.perf_counter()
    weights = random_weights(config, args.seed, "float32")  # in memory, never written
    ckpt = Checkpoint(path=Path("<random weights>"), config=config, weights=weights)
    mlx_lm = MlxLmImpl(ckpt)  # the same weight arrays, no copy
    held = sum(w.nbytes for w in weights.values())
    harness.log(f"random weights: {held / 1e9:.2f} GB, built in {time.perf_counter() - t:.1f} s")
    block, model, checks, breakdown = [], [], [], {}
    if "block" in args.parts:
        block, checks, breakdown = bench_block(pkg, ckpt, mlx_lm, args, ceilings)
    if "model" in args.parts:
        model, more = bench_model(pkg, ckpt, mlx_lm, args, ceilings)
        checks += more
    one = expert_bytes(config)
    settings = {
        **harness.arguments_json(args, ["json_output"]), "device": device, "dtype": "float32",
        "load_average_at_start": list(load), "load_average_at_end": list(os.getloadavg()),
        "config": config.raw,
        "weights": {"random": True, "seed": args.seed, "expert_bytes": one,
                    "experts_bytes_per_layer": config.num_experts * one,
                    "active_expert_bytes_per_token_per_layer": config.num_experts_per_tok * one},
        "mlx_lm": {"version": harness.package_version("mlx-lm"), "block": "mlx_lm.models.qwen3_moe."
                   "Qwen3MoeSparseMoeBlock (SwitchGLU), in the Model tiny_llm_support.mlx_lm_qwen3 "
                   "builds on the same weight arrays"},
    }  # fmt: skip
    agreement = {"reference": "grouped", **harness.agreement_summary(checks, AGREEMENT_RTOL)}
    summary = {"ceilings": ceilings, "agreement": agreement}
    if breakdown:
        summary["own_kernel_prefill_breakdown"] = breakdown
    blas = {**harness.process_blas(), "openblas_core": core, "environment": harness.environment()}
    return harness.report("moe", started, settings, block + model, summary, targets(block), blas)

"""Week 4 Day 1: what quantized weights and an INT8 KV cache save, and what they cost.

Three parts (--parts), in this process, on the reference solution (tiny_llm_ref):
weights    the model (default: Qwen3-0.6B's shape, random weights) in float32 and in MLX's affine
           format at each --bits (groups of 64), on every quantized_linear path: the bytes it
           holds, prefill tokens/s (median of --repeats) and decode ms/token (batch 1);
kv         float32 weights with the float32 and the INT8 KV cache, filled with random keys and
           values to each --contexts length: bytes per token and decode ms/token;
agreement  the tiny checkpoint in float32, at each --bits and with an INT8 cache: how many greedy
           tokens match float32's, and the argmax agreement when every variant reads float32's
           tokens (teacher forcing).

    pdm run bench-quantization
"""

from __future__ import annotations

import gc
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

import tiny_llm_ref as ref
from benches import harness
from benches.ceilings import timed
from tiny_llm_support import (
    choose_device,
    load_checkpoint,
    make_tiny_checkpoint,
    quantize_checkpoint,
)
from tiny_llm_support.cli import int_at_least

GROUP_SIZE = 64
AGREEMENT_PROMPTS = ("The quick brown fox", "Once upon a time there was a little cat",
                     "def add(a, b):", "The attention layer compares every query")  # fmt: skip


def model_bytes(model: Any) -> int:
    """Bytes of every array the model holds (weights, RoPE tables), each counted once."""
    seen: set[int] = set()

    def visit(obj: Any) -> int:
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            return obj.nbytes
        if isinstance(obj, (list, tuple)):
            return sum(visit(item) for item in obj)
        return sum(visit(v) for v in vars(obj).values()) if hasattr(obj, "__dict__") else 0

    return visit(model)


def release(cache: list) -> None:
    for layer_cache in cache:
        layer_cache.release()


def decode_ms(model: Any, cache: list, start: int, steps: int) -> list[float]:
    """ms of each decode step (batch 1, a fixed token) from `start`, after one untimed step."""
    token = mx.array([[7]])  # [1, 1]
    times = [timed(lambda p=p: model(token, p, cache)) for p in range(start, start + steps + 1)]
    return [1000 * t for t in times[1:]]


def speed(model: Any, args) -> dict[str, Any]:
    """Decode ms/token after an 8-token prompt (also the warm-up), and prefill tokens/s of one
    prompt of --prefill-tokens (medians)."""
    prompt = mx.arange(args.prefill_tokens)[None] % 1000 + 100  # [1, T], ordinary Qwen3 ids
    cache = model.create_kv_cache()
    mx.eval(model(prompt[:, :8], 0, cache, logits_to_keep=1))
    decode = decode_ms(model, cache, 8, args.decode_steps)
    release(cache)
    prefill = []
    for _ in range(args.repeats):
        cache = model.create_kv_cache()
        prefill.append(timed(lambda c=cache: model(prompt, 0, c, logits_to_keep=1)))
        release(cache)
    return {"prefill_tokens_per_s": args.prefill_tokens / harness.median(prefill),
            "prefill_s_runs": prefill, "decode_ms_per_token": harness.median(decode),
            "decode_ms_runs": decode}  # fmt: skip


def weights_part(ckpt, args) -> list[dict[str, Any]]:
    variants = [("float32", None, None)]
    variants += [(f"{bits}bit", bits, path) for bits in args.bits for path in args.paths]
    rows = []
    for name, bits, path in variants:
        source = ckpt if bits is None else quantize_checkpoint(ckpt, bits, GROUP_SIZE)
        model = ref.Qwen3Model(source, quantized_linear=path)
        row = {"part": "weights", "weights": name, "bits": bits, "quantized_linear": path}
        rows.append({**row, "model_bytes": model_bytes(model), **speed(model, args)})
        harness.log(f"weights {name} {path or ''}: {rows[-1]['model_bytes'] / 2**20:.1f} MiB, "
                    f"decode {rows[-1]['decode_ms_per_token']:.1f} ms/token")  # fmt: skip
        del model, source
        gc.collect()
        mx.clear_cache()
    return rows


def kv_part(ckpt, args) -> list[dict[str, Any]]:
    c, rows = ckpt.config, []
    for kv_bits in (None, 8):
        model = ref.Qwen3Model(ckpt, kv_bits=kv_bits, kv_group_size=GROUP_SIZE)
        for context in args.contexts:
            cache = model.create_kv_cache()
            shape = (1, c.num_key_value_heads, context, c.head_dim)
            for i, layer_cache in enumerate(cache):
                keys = mx.random.normal(shape, key=mx.random.key(2 * i))
                values = mx.random.normal(shape, key=mx.random.key(2 * i + 1))
                layer_cache.update_and_fetch(keys, values)
                layer_cache.materialize()
            # the INT8 cache counts its own bytes (the contexts fill its 256-token blocks)
            held = sum(x.nbytes if kv_bits else x.keys.nbytes + x.values.nbytes for x in cache)
            decode = decode_ms(model, cache, context, args.decode_steps)
            release(cache)
            name, ms = "int8" if kv_bits else "float32", harness.median(decode)
            rows.append({"part": "kv", "kv_cache": name, "context": context,
                         "kv_bytes_per_token": held / context, "decode_ms_per_token": ms,
                         "decode_ms_runs": decode})  # fmt: skip
            harness.log(f"kv {name} at {context}: {held / context:.0f} bytes/token, "
                        f"decode {ms:.1f} ms/token")  # fmt: skip
            mx.clear_cache()
        del model
        gc.collect()
    return rows


def forced_argmax(model: Any, tokens: mx.array, n: int) -> list[int]:
    """The argmax at the last n positions of one forward pass over tokens [1, T]."""
    cache = model.create_kv_cache()
    logits = model(tokens, 0, cache, logits_to_keep=n)  # [1, n, V]
    release(cache)
    return mx.argmax(logits[0], axis=-1).tolist()


def agreement_part(args, workdir: Path) -> dict[str, Any]:
    """Per variant: every prompt's matching prefix and forced agreement, and their means."""
    ckpt = load_checkpoint(make_tiny_checkpoint(workdir / "float", seed=0))
    tokenizer, float32 = ckpt.tokenizer, ref.Qwen3Model(ckpt)
    variants = {}
    for bits in args.bits:
        quantized = make_tiny_checkpoint(workdir / f"q{bits}", quantize=bits)
        variants[f"{bits}bit"] = ref.Qwen3Model(load_checkpoint(quantized))
    # and the INT8 KV cache; the tiny model's head_dim is 32: groups of 32
    variants["int8-kv"] = ref.Qwen3Model(ckpt, kv_bits=8, kv_group_size=32)
    n = args.agreement_tokens
    prompts: dict[str, list] = {name: [] for name in variants}
    for text in AGREEMENT_PROMPTS:
        prompt = tokenizer.encode(text)
        reference = list(ref.simple_generate_with_kv_cache(float32, prompt, n))
        forced = mx.array([prompt + reference[:-1]])  # [1, T]: every variant reads these tokens
        want = forced_argmax(float32, forced, n)
        for name, model in variants.items():
            own = list(ref.simple_generate_with_kv_cache(model, prompt, n))
            same = sum(a == b for a, b in zip(forced_argmax(model, forced, n), want))
            prefix = harness.first_difference(own, reference, n)
            prompts[name].append({"prompt": text, "matching_prefix": prefix, "forced_agree": same})
    return {name: {"tokens": n, "prompts": rows,
                   "mean_matching_prefix": statistics.fmean(r["matching_prefix"] for r in rows),
                   "forced_agreement": sum(r["forced_agree"] for r in rows) / (n * len(rows))}
            for name, rows in prompts.items()}  # fmt: skip


def summary_table(report: dict[str, Any]) -> str:
    runs = report["runs"]
    weights = [(r["weights"], r["quantized_linear"] or "", f"{r['model_bytes'] / 2**20:.1f}",
                f"{r['prefill_tokens_per_s']:.1f}", f"{r['decode_ms_per_token']:.1f}")
               for r in runs if r["part"] == "weights"]  # fmt: skip
    kv = [(r["kv_cache"], str(r["context"]), f"{r['kv_bytes_per_token']:.0f}",
           f"{r['decode_ms_per_token']:.1f}") for r in runs if r["part"] == "kv"]  # fmt: skip
    agree = [(name, f"{s['mean_matching_prefix']:.1f} of {s['tokens']}",
              f"{s['forced_agreement']:.1%}")
             for name, s in report["summary"].get("agreement", {}).items()]  # fmt: skip
    tables = [(("weights", "path", "MiB", "prefill tokens/s", "decode ms"), weights),
              (("KV cache", "context", "bytes/token", "decode ms"), kv),
              (("variant", "matching prefix", "forced agreement"), agree)]  # fmt: skip
    return "\n".join(harness.table(head, rows) for head, rows in tables if rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.bench_parser("bench-quantization", __doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a shortcut with an embedded config, or "
                   "a checkpoint directory (its config, with random weights)")  # fmt: skip
    p.add_argument("--num-layers", type=int_at_least(1), default=None, help="default: all")
    p.add_argument("--parts", nargs="+", choices=["weights", "kv", "agreement"],
                   default=["weights", "kv", "agreement"])  # fmt: skip
    p.add_argument("--bits", nargs="+", type=int, choices=[4, 8], default=[8, 4])
    week4 = [path for path in ref.QUANTIZED_LINEAR_PATHS if path != "own-kernel"]  # 5.1's own
    p.add_argument("--paths", nargs="+", choices=ref.QUANTIZED_LINEAR_PATHS, default=week4,
                   help="default: Week 4's (own-kernel is measured by bench-own-kernel)")  # fmt: skip
    p.add_argument("--prefill-tokens", type=int_at_least(8), default=128)
    p.add_argument("--decode-steps", type=int_at_least(1), default=8)
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="prefill runs kept")
    p.add_argument("--contexts", nargs="+", type=int_at_least(256), default=[1024, 4096],
                   help="KV context lengths, multiples of 256")  # fmt: skip
    p.add_argument("--agreement-tokens", type=int_at_least(1), default=64)
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--no-openblas", action="store_true", help="keep the bundled BLAS (Linux)")
    harness.add_output_arguments(p, "quantization-<model>-<N>layers-<os>-<arch>.json")
    args = p.parse_args(argv)
    if any(c % 256 for c in args.contexts):
        p.error("--contexts must be multiples of 256 (the caches grow in blocks of 256)")
    model = harness.bench_model_or_exit(p, args.model, random=True, num_layers=args.num_layers)
    longest = max(args.prefill_tokens, max(args.contexts) + args.decode_steps)
    limit = int(model.config["max_position_embeddings"])
    if longest > limit:
        p.error(f"{longest} positions (--prefill-tokens, or --contexts + --decode-steps) exceed "
                f"the model's max_position_embeddings ({limit})")  # fmt: skip
    host = f"{platform.system().lower()}-{platform.machine()}"
    name = f"quantization-{harness.model_slug(model)}-{model.num_layers}layers-{host}.json"
    harness.set_output_paths(p, args, harness.RESULTS / name)

    started = time.time()
    settings = {**harness.arguments_json(args, ["json_output"]),
                "device": choose_device(args.device), "model": model.describe(),
                "group_size": GROUP_SIZE,
                "default_quantized_linear": ref.default_quantized_linear()}  # fmt: skip
    runs, summary = [], {}
    if "weights" in args.parts or "kv" in args.parts:
        ckpt = model.load("float32")
        runs += weights_part(ckpt, args) if "weights" in args.parts else []
        runs += kv_part(ckpt, args) if "kv" in args.parts else []
        del ckpt
    if "agreement" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            summary["agreement"] = agreement_part(args, Path(tmp))
    report = harness.report("quantization", started, settings, runs, summary)
    harness.write_report(args, report, summary_table, seconds=report["host"]["duration_s"])
    return 0

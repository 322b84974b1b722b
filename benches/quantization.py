"""Week 4 Day 1: what quantized weights and an INT8 KV cache save, and what they cost.

Three parts, each optional (--parts):

weights    A model of the given shape (default: Qwen3-0.6B's config, random weights) in
           float32 and in MLX's affine format at each --bits (groups of 64), on every path of
           Qwen3Model's quantized_linear: the bytes the model holds, prefill tokens/s (one
           prompt of --prefill-tokens, median of --repeats) and decode ms/token (batch 1,
           median of --decode-steps steps after an 8-token prompt).
kv         float32 weights; the float32 cache against the INT8 cache (groups of 64): KV bytes
           per token, and decode ms/token at each --contexts length. The caches are filled
           with random keys and values (no prefill), then --decode-steps steps run.
agreement  The tiny checkpoint (make_tiny_checkpoint, seed 0) in float32, 8-bit and 4-bit
           weights, and float32 weights with an INT8 cache: over --agreement-tokens greedy
           tokens from each of four prompts, how many leading tokens equal float32's, and the
           share of positions where the argmax equals float32's when every variant reads
           float32's tokens (teacher forcing).

    pdm run bench-quantization
    pdm run bench-quantization --num-layers 2 --prefill-tokens 16 --decode-steps 2 \\
        --contexts 256 --repeats 1 --agreement-tokens 8          # a smoke run, seconds

Writes JSON to benches/results/quantization-<model>-<layers>layers-<platform>.json (or
--json-output).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C, SIGTERM or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import mlx.core as mx
from common import (
    RESULTS,
    BenchModel,
    add_output_arguments,
    arguments_json,
    bench_model_or_exit,
    check_outputs,
    host_info,
    mlx_info,
    write_json,
)

import tiny_llm_ref as ref
from tiny_llm_support import (
    Checkpoint,
    CheckpointError,
    blas_info,
    choose_device,
    load_checkpoint,
    make_tiny_checkpoint,
    quantize_checkpoint,
)
from tiny_llm_support.cli import int_at_least, run_script

SCHEMA = "tiny-llm/bench-quantization/v1"
GROUP_SIZE = 64
AGREEMENT_PROMPTS = (
    "The quick brown fox",
    "Once upon a time there was a little cat",
    "def add(a, b):",
    "The attention layer compares every query",
)


def timed(fn: Callable[..., mx.array], *args: Any, **kwargs: Any) -> float:
    """Seconds for fn(*args, **kwargs) and the evaluation of what it returns."""
    start = time.perf_counter()
    mx.eval(fn(*args, **kwargs))
    return time.perf_counter() - start


def model_bytes(model: Any) -> int:
    """Bytes of every array the model holds (weights, RoPE tables), each counted once."""
    seen: set[int] = set()
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            total += obj.nbytes
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                visit(value)

    visit(model)
    return total


def release(cache: list) -> None:
    for layer_cache in cache:
        layer_cache.release()


def speed(model: Any, prefill_tokens: int, decode_steps: int, repeats: int) -> dict[str, Any]:
    """Decode ms/token at batch 1 after an 8-token prompt (which is also the warm-up), and
    prefill tokens/s of one prompt (medians)."""
    prompt = mx.arange(prefill_tokens)[None] % 1000 + 100  # ordinary Qwen3 token ids
    cache = model.create_kv_cache()
    mx.eval(model(prompt[:, :8], 0, cache, logits_to_keep=1))  # also the warm-up
    token, decode_s = mx.array([[7]]), []
    for step in range(decode_steps + 1):
        seconds = timed(model, token, 8 + step, cache)
        if step > 0:  # the first step after a prefill is a warm-up
            decode_s.append(seconds)
    release(cache)
    prefill_s = []
    for _ in range(repeats):
        cache = model.create_kv_cache()
        prefill_s.append(timed(model, prompt, 0, cache, logits_to_keep=1))
        release(cache)
    prefill = statistics.median(prefill_s)
    return {
        "prefill_tokens_per_s": prefill_tokens / prefill,
        "prefill_s_runs": prefill_s,
        "decode_ms_per_token": 1000 * statistics.median(decode_s),
        "decode_ms_runs": [1000 * s for s in decode_s],
    }


def weights_part(ckpt: Checkpoint, args: argparse.Namespace) -> list[dict[str, Any]]:
    variants: list[tuple[str, int | None, str | None]] = [("float32", None, None)]
    variants += [(f"{bits}bit", bits, path) for bits in args.bits for path in args.paths]
    rows = []
    for name, bits, path in variants:
        source = ckpt if bits is None else quantize_checkpoint(ckpt, bits, GROUP_SIZE)
        model = ref.Qwen3Model(source, quantized_linear=path)
        row = {"weights": name, "bits": bits, "quantized_linear": path}
        row["model_bytes"] = model_bytes(model)
        row.update(speed(model, args.prefill_tokens, args.decode_steps, args.repeats))
        print(
            f"weights {name:8} {path or '':20} {row['model_bytes'] / 2**20:8.1f} MiB   prefill "
            f"{row['prefill_tokens_per_s']:8.1f} tok/s   decode {row['decode_ms_per_token']:8.1f} "
            "ms/token",
            flush=True,
        )
        rows.append(row)
        del model, source
        gc.collect()
        mx.clear_cache()
    return rows


def kv_part(ckpt: Checkpoint, args: argparse.Namespace) -> list[dict[str, Any]]:
    c = ckpt.config
    rows = []
    for kv_bits in (None, 8):
        model = ref.Qwen3Model(ckpt, kv_bits=kv_bits, kv_group_size=GROUP_SIZE)
        for context in args.contexts:
            cache = model.create_kv_cache()
            for i, layer_cache in enumerate(cache):
                shape = (1, c.num_key_value_heads, context, c.head_dim)
                key = mx.random.normal(shape, key=mx.random.key(2 * i))
                value = mx.random.normal(shape, key=mx.random.key(2 * i + 1))
                layer_cache.update_and_fetch(key, value)
                layer_cache.materialize()
            held = sum(cache_bytes(layer_cache) for layer_cache in cache)
            token, decode_s = mx.array([[7]]), []
            for step in range(args.decode_steps + 1):
                seconds = timed(model, token, context + step, cache)
                if step > 0:
                    decode_s.append(seconds)
            release(cache)
            row = {
                "kv_cache": "int8" if kv_bits else "float32",
                "context": context,
                "kv_bytes_per_token": held / context,
                "decode_ms_per_token": 1000 * statistics.median(decode_s),
                "decode_ms_runs": [1000 * s for s in decode_s],
            }
            print(
                f"kv {row['kv_cache']:8} context {context:6}   {row['kv_bytes_per_token']:9.0f} "
                f"bytes/token   decode {row['decode_ms_per_token']:8.1f} ms/token",
                flush=True,
            )
            rows.append(row)
            mx.clear_cache()
        del model
        gc.collect()
    return rows


def cache_bytes(layer_cache: Any) -> int:
    """Bytes a layer's cache holds: the INT8 cache counts its own; the float one is two
    arrays. The contexts are whole multiples of the caches' 256-token blocks."""
    if isinstance(layer_cache, ref.TinyKvQuantizedCache):
        return layer_cache.nbytes
    return layer_cache.keys.nbytes + layer_cache.values.nbytes


def agreement_part(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    float_dir = make_tiny_checkpoint(workdir / "float", seed=0)
    tokenizer = load_checkpoint(float_dir).tokenizer
    variants = {"float32": ref.Qwen3Model(load_checkpoint(float_dir))}
    for bits in args.bits:  # the widths asked for, as in the weights part
        quantized = make_tiny_checkpoint(workdir / f"q{bits}", quantize=bits)
        variants[f"{bits}bit"] = ref.Qwen3Model(load_checkpoint(quantized))
    # the INT8 KV cache (always 8 bits); the tiny model's head_dim is 32: groups of 32
    variants["int8-kv"] = ref.Qwen3Model(load_checkpoint(float_dir), kv_bits=8, kv_group_size=32)
    n = args.agreement_tokens
    results: dict[str, Any] = {name: [] for name in variants if name != "float32"}
    for text in AGREEMENT_PROMPTS:
        prompt = tokenizer.encode(text)
        reference = list(ref.simple_generate_with_kv_cache(variants["float32"], prompt, n))
        forced = mx.array([prompt + reference[:-1]])  # every variant reads float32's tokens
        want = forced_argmax(variants["float32"], forced, n)
        for name, model in variants.items():
            if name == "float32":
                continue
            own = list(ref.simple_generate_with_kv_cache(model, prompt, n))
            prefix = next((i for i, (a, b) in enumerate(zip(own, reference)) if a != b), n)
            same = sum(a == b for a, b in zip(forced_argmax(model, forced, n), want))
            results[name].append({"prompt": text, "matching_prefix": prefix, "forced_agree": same})
    summary = {
        name: {
            "tokens": n,
            "prompts": rows,
            "mean_matching_prefix": statistics.fmean(r["matching_prefix"] for r in rows),
            "forced_agreement": sum(r["forced_agree"] for r in rows) / (n * len(rows)),
        }
        for name, rows in results.items()
    }
    for name, s in summary.items():
        print(
            f"agreement {name:8} mean matching prefix {s['mean_matching_prefix']:5.1f} of {n}"
            f"   teacher-forced argmax agreement {s['forced_agreement']:.1%}",
            flush=True,
        )
    return summary


def forced_argmax(model: Any, tokens: mx.array, n: int) -> list[int]:
    """The argmax at the last n positions of one forward pass over tokens [1, T]."""
    cache = model.create_kv_cache()
    logits = model(tokens, 0, cache, logits_to_keep=n)  # [1, n, V]
    release(cache)
    return mx.argmax(logits[0], axis=-1).tolist()


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, BenchModel]:
    """The arguments and the model they name (its config: the weights are random), with the
    JSON's path checked."""
    p = argparse.ArgumentParser(prog="bench-quantization", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="qwen3-0.6b",
        help="a shortcut with an embedded config, or a checkpoint directory (its config is "
        "used with random weights)",
    )
    p.add_argument("--num-layers", type=int_at_least(1), default=None, help="default: all")
    p.add_argument("--parts", nargs="+", choices=["weights", "kv", "agreement"],
                   default=["weights", "kv", "agreement"])  # fmt: skip
    p.add_argument("--bits", nargs="+", type=int, choices=[4, 8], default=[8, 4])
    p.add_argument("--paths", nargs="+", choices=ref.QUANTIZED_LINEAR_PATHS,
                   default=list(ref.QUANTIZED_LINEAR_PATHS))  # fmt: skip
    p.add_argument("--prefill-tokens", type=int_at_least(8), default=128)
    p.add_argument("--decode-steps", type=int_at_least(1), default=8)
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="prefill runs kept")
    p.add_argument("--contexts", nargs="+", type=int_at_least(256), default=[1024, 4096],
                   help="KV context lengths, multiples of 256")  # fmt: skip
    p.add_argument("--agreement-tokens", type=int_at_least(1), default=64)
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    add_output_arguments(p, "quantization-<model>-<layers>layers-<os>-<arch>.json")
    args = p.parse_args(argv)
    if any(c % 256 for c in args.contexts):
        p.error("--contexts must be multiples of 256 (the caches grow in blocks of 256)")
    bench_model = bench_model_or_exit(p, args.model, random=True, num_layers=args.num_layers)
    if args.json_output is None:
        slug = f"{args.model}-{bench_model.num_layers}layers-{platform.system().lower()}"
        args.json_output = RESULTS / f"quantization-{slug}-{platform.machine()}.json"
    check_outputs(p, args.json_output)
    return args, bench_model


def main(argv: Sequence[str] | None = None) -> int:
    args, bench_model = parse_args(argv)
    device = choose_device(args.device)
    longest = max(args.prefill_tokens, max(args.contexts) + args.decode_steps)
    limit = int(bench_model.config["max_position_embeddings"])
    if longest > limit:
        sys.exit(
            f"error: {longest} positions (--prefill-tokens, or --contexts + --decode-steps) "
            f"exceed the model's max_position_embeddings ({limit})"
        )
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "host": host_info(),
        "mlx": mlx_info(),
        "blas": blas_info(),
        "device": device,
        "default_quantized_linear": ref.default_quantized_linear(),
        "args": arguments_json(args),
        "model": bench_model.describe(),
        "group_size": GROUP_SIZE,
    }
    started = time.perf_counter()
    if "weights" in args.parts or "kv" in args.parts:
        try:
            ckpt = bench_model.load("float32")
        except CheckpointError as e:  # a config that could not be checked without the weights
            raise SystemExit(f"error: {e}") from None
        if "weights" in args.parts:
            report["weights"] = weights_part(ckpt, args)
        if "kv" in args.parts:
            report["kv"] = kv_part(ckpt, args)
        del ckpt
    if "agreement" in args.parts:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            report["agreement"] = agreement_part(args, Path(tmp))
    report["wall_s"] = time.perf_counter() - started
    write_json(args.json_output, report)
    print(f"wrote {args.json_output} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    run_script(main)

"""Loading Qwen3 checkpoints in Hugging Face layout (safetensors only, never pickle). What a
checkpoint must hold, and the checks on what was read, are checkpoint_checks'."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .checkpoint_checks import check_finite, check_shard_name, check_vocabulary, check_weights
from .checkpoint_files import CheckpointError, check_safetensors, read_json_object
from .config import Qwen3Config
from .quant_format import Quantization, check_quant_format
from .tokenizer import Tokenizer, load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
TENSOR_PARTS = ("weight", "scales", "biases")  # a layer's tensors; the last two when quantized


@dataclass
class Checkpoint:
    """A loaded checkpoint: its directory, parsed config, weights by HF name, and tokenizer."""

    path: Path
    config: Qwen3Config
    weights: dict[str, mx.array]
    tokenizer: Tokenizer | None = None


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stack_experts(weights: dict[str, mx.array], config: Qwen3Config, path: Path) -> None:
    """Hugging Face's layout, one tensor per expert (`mlp.experts.{j}.up_proj.weight`), turned
    into the stacked one (`mlp.switch_mlp.up_proj.weight`, experts along the first axis) in
    place; a quantized expert's scales and biases are stacked alike. A checkpoint already
    stacked (mlx-lm's convert) is left as it is; a missing expert is an error naming it."""
    for layer in range(config.num_hidden_layers):
        if not config.is_sparse(layer):
            continue
        p = f"model.layers.{layer}.mlp."
        for proj, part in itertools.product(EXPERT_PROJECTIONS, TENSOR_PARTS):
            names = [f"{p}experts.{j}.{proj}.{part}" for j in range(config.num_experts)]
            found = [name for name in names if name in weights]
            if not found:
                continue
            missing = [name for name in names if name not in weights]
            if missing:
                raise CheckpointError(
                    f"{path}: tensor {missing[0]} is missing (layer {layer} has "
                    f"{config.num_experts} experts, {len(found)} of them found)"
                )
            weights[f"{p}switch_mlp.{proj}.{part}"] = mx.stack([weights.pop(n) for n in names])


def quantize_weights(
    weights: dict[str, mx.array], group_size: int = 64, bits: int = 4
) -> dict[str, mx.array]:
    """The weights in MLX's affine format, as mlx-lm's convert writes them: each 2-D weight
    (and each stack of experts' weights) whose input size group_size divides becomes codes,
    scales and biases (mx.quantize); norms and the other weights stay float. A tensor held under two names (a tied head) is
    quantized once."""
    check_quant_format(group_size, bits, "quantize_weights")
    out, done = {}, {}
    for name, w in weights.items():
        if w.ndim < 2 or w.shape[-1] % group_size != 0:
            out[name] = w
            continue
        if id(w) not in done:
            done[id(w)] = mx.quantize(w, group_size=group_size, bits=bits)
        layer = name.removesuffix(".weight")
        out.update(zip([f"{layer}.{part}" for part in TENSOR_PARTS], done[id(w)]))
    return out


def quantize_checkpoint(ckpt: Checkpoint, bits: int = 4, group_size: int = 64) -> Checkpoint:
    """A float checkpoint quantized in memory (quantize_weights), its config saying so."""
    config = dataclasses.replace(ckpt.config, quantization=Quantization(group_size, bits))
    weights = quantize_weights(ckpt.weights, group_size, bits)
    return Checkpoint(ckpt.path, config, weights, ckpt.tokenizer)


def to_mx_dtype(dtype: mx.Dtype | str) -> mx.Dtype:
    """Accept an mx dtype or one of "float32", "bfloat16", "float16"."""
    if isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_checkpoint(path: str | Path, dtype: mx.Dtype | str | None = None) -> Checkpoint:
    """Load config.json, the safetensors weights (single file or sharded) and the tokenizer.
    Any file that is missing or cannot be read raises CheckpointError, naming it, and so do
    contents that would load but compute garbage: a tokenizer with ids past the config's
    vocab_size, NaN or inf in a weight."""
    path = Path(path).expanduser()
    target = to_mx_dtype(dtype) if dtype is not None else None
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    config = Qwen3Config.from_file(path / "config.json")
    files = safetensors_files(path)
    for file in files:
        check_safetensors(file)  # before MLX reads it
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    if tokenizer is not None:
        check_vocabulary(tokenizer, config, path)
    weights: dict[str, mx.array] = {}
    tensor_files: dict[str, Path] = {}  # tensor name -> the file it came from, for messages
    for file in files:
        loaded = read_safetensors(file)
        weights.update(loaded)
        tensor_files.update(dict.fromkeys(loaded, file))
    _tie_lm_head(weights, config, path)
    stack_experts(weights, config, path)
    check_weights(weights, config, path, tensor_files)
    if target is not None:
        weights = _convert(weights, target)
    check_finite(weights, path, tensor_files)
    return Checkpoint(path=path, config=config, weights=weights, tokenizer=tokenizer)


def read_safetensors(file: Path) -> dict[str, mx.array]:
    """The tensors of one safetensors file (check_safetensors has checked its header)."""
    try:
        return mx.load(str(file))
    except (RuntimeError, ValueError, OSError) as e:  # e.g. a dtype MLX cannot hold
        raise CheckpointError(f"{file}: cannot be read ({e})") from None


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the shard index names, else model.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map naming the weight files")
        for tensor, name in weight_map.items():
            check_shard_name(index, str(tensor), str(name))
        files = [path / str(name) for name in sorted(set(map(str, weight_map.values())))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names {file.name}, which does not exist")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{pickles[0]} is a PyTorch pickle file; only safetensors checkpoints are supported "
            "(pickle files can run arbitrary code when loaded)"
        )
    raise CheckpointError(f"no *.safetensors weight files in {path}")


def _tie_lm_head(weights: dict[str, mx.array], config: Qwen3Config, path: Path) -> None:
    if "lm_head.weight" in weights:
        return
    if not config.tie_word_embeddings:
        raise CheckpointError(
            f"{path}: tensor lm_head.weight is missing and tie_word_embeddings is false"
        )
    for part in TENSOR_PARTS:  # a quantized embedding ties its scales and biases too
        if f"model.embed_tokens.{part}" in weights:
            weights[f"lm_head.{part}"] = weights[f"model.embed_tokens.{part}"]


def _convert(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Cast every floating-point weight (quantized codes stay uint32); a tied lm_head stays
    the same array as the embedding."""
    converted = {}
    for name, w in weights.items():
        converted[name] = w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w
    for part in TENSOR_PARTS:
        embed = weights.get(f"model.embed_tokens.{part}")
        if embed is not None and weights.get(f"lm_head.{part}") is embed:
            converted[f"lm_head.{part}"] = converted[f"model.embed_tokens.{part}"]
    return converted

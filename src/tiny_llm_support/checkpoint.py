"""Loading Qwen3 checkpoints in Hugging Face layout (safetensors only, never pickle)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .checkpoint_files import CheckpointError, check_safetensors, read_json_object
from .config import Quantization, Qwen3Config, check_quant_format
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


def expected_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3 checkpoint with this config must have, with its shape."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_dim),
                p + "self_attn.q_norm.weight": (config.head_dim,),
                p + "self_attn.k_norm.weight": (config.head_dim,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def quantize_weights(
    weights: dict[str, mx.array], group_size: int = 64, bits: int = 4
) -> dict[str, mx.array]:
    """The weights in MLX's affine format, as mlx-lm's convert writes them: each 2-D weight
    whose input size group_size divides becomes codes, scales and biases (mx.quantize); norms
    and the other weights stay float. A tensor held under two names (a tied head) is
    quantized once."""
    check_quant_format(group_size, bits, "quantize_weights")
    out, done = {}, {}
    for name, w in weights.items():
        if w.ndim != 2 or w.shape[1] % group_size != 0:
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
    Any file that is missing or cannot be read raises CheckpointError, naming it."""
    path = Path(path).expanduser()
    target = to_mx_dtype(dtype) if dtype is not None else None
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    config = Qwen3Config.from_file(path / "config.json")
    files = safetensors_files(path)
    for file in files:
        check_safetensors(file)  # before MLX reads it
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    weights: dict[str, mx.array] = {}
    tensor_files: dict[str, Path] = {}  # tensor name -> the file it came from, for messages
    for file in files:
        loaded = read_safetensors(file)
        weights.update(loaded)
        tensor_files.update(dict.fromkeys(loaded, file))
    _tie_lm_head(weights, config, path)
    check_weights(weights, config, path, tensor_files)
    if target is not None:
        weights = _convert(weights, target)
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


def check_weights(
    weights: dict[str, mx.array],
    config: Qwen3Config,
    path: Path,
    files: dict[str, Path] | None = None,
) -> None:
    """Every expected tensor must be present with the expected shape and a floating-point
    dtype; extras are ignored. A quantized layer (its `.scales` present) is checked in its
    packed layout instead: uint32 codes, float scales and biases."""
    where = lambda name: (files or {}).get(name, path)
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise CheckpointError(
                f"{path}: tensor {name} is missing (expected shape {list(shape)})"
            )
        layer = name.removesuffix(".weight")
        if len(shape) == 2 and (f"{layer}.scales" in weights or weights[name].dtype == mx.uint32):
            check_quantized(weights, config, layer, shape, where)
            continue
        got = tuple(weights[name].shape)
        if got != shape:
            raise CheckpointError(
                f"{where(name)}: tensor {name} has shape {list(got)}, expected {list(shape)}"
            )
        check_float(weights, name, where)


def check_float(weights: dict[str, mx.array], name: str, where: Callable[[str], Path]) -> None:
    """A weight that is not floating point (an int32 norm, say) would compute garbage."""
    dtype = weights[name].dtype
    if not mx.issubdtype(dtype, mx.floating):
        raise CheckpointError(
            f"{where(name)}: tensor {name} is {dtype_name(dtype)}, not a floating-point type "
            "(weights are float32, bfloat16 or float16; only a quantized layer's codes are "
            "uint32)"
        )


def check_quantized(
    weights: dict[str, mx.array],
    config: Qwen3Config,
    layer: str,
    shape: tuple[int, ...],
    where: Callable[[str], Path],
) -> None:
    """A layer in MLX's affine format: weight holds the codes [O, I * bits / 32] as uint32,
    scales and biases [O, I / group_size], with group_size and bits from config.json."""
    fmt = config.quantization.of(layer) if config.quantization is not None else None
    if fmt is None:
        raise CheckpointError(
            f"{where(layer + '.weight')}: tensor {layer}.weight is quantized (uint32 codes or "
            f"a {layer}.scales tensor), but config.json's quantization entry does not cover it"
        )
    group_size, bits = fmt
    rows, cols = shape
    if cols % group_size != 0:
        raise CheckpointError(
            f"{where(layer + '.weight')}: {layer} has {cols} inputs, not a multiple of "
            f"group_size {group_size}"
        )
    packed = {
        "weight": (rows, cols * bits // 32),
        "scales": (rows, cols // group_size),
        "biases": (rows, cols // group_size),
    }
    for part, want in packed.items():
        name = f"{layer}.{part}"
        if name not in weights:
            raise CheckpointError(
                f"{where(layer + '.weight')}: tensor {name} is missing (a quantized layer has "
                "weight, scales and biases)"
            )
        got = tuple(weights[name].shape)
        if got != want:
            raise CheckpointError(
                f"{where(name)}: tensor {name} has shape {list(got)}, expected {list(want)} "
                f"({bits}-bit codes of a {list(shape)} weight, {32 // bits} to a uint32, one "
                f"scale and bias per group of {group_size})"
            )
    check_float(weights, f"{layer}.scales", where)
    check_float(weights, f"{layer}.biases", where)
    if weights[f"{layer}.weight"].dtype != mx.uint32:
        raise CheckpointError(
            f"{where(layer + '.weight')}: tensor {layer}.weight is "
            f"{dtype_name(weights[layer + '.weight'].dtype)}; "
            "the codes of a quantized layer are uint32"
        )


def dtype_name(dtype: mx.Dtype) -> str:
    """ "int32" for mx.int32."""
    return str(dtype).removeprefix("mlx.core.")


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

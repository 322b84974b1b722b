"""Loading Qwen3 checkpoints in Hugging Face layout (safetensors only, never pickle)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import mlx.core as mx

from .checkpoint_files import CheckpointError, check_safetensors, read_json_object
from .config import Quantization, Qwen3Config, check_quant_format
from .tokenizer import Tokenizer, load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
TENSOR_PARTS = ("weight", "scales", "biases")  # a layer's tensors; the last two when quantized
FINITE_BATCH = 32  # tensors per evaluation of the NaN/inf check


@dataclass
class Checkpoint:
    """A loaded checkpoint: its directory, parsed config, weights by HF name, and tokenizer."""

    path: Path
    config: Qwen3Config
    weights: dict[str, mx.array]
    tokenizer: Tokenizer | None = None


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expected_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3 checkpoint with this config must have, with its shape. A sparse
    layer (Week 4 Day 6) has a router, `mlp.gate`, and its experts' weights stacked along a
    first axis, under mlx-lm's names (`mlp.switch_mlp.*`): load_checkpoint stacks the one
    tensor per expert that Hugging Face checkpoints hold (stack_experts)."""
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
                **(
                    mlp_shapes(config, i)
                    if config.is_sparse(i)
                    else {
                        p + "mlp.gate_proj.weight": (inter, hidden),
                        p + "mlp.up_proj.weight": (inter, hidden),
                        p + "mlp.down_proj.weight": (hidden, inter),
                    }
                ),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def mlp_shapes(config: Qwen3Config, layer: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router [experts, hidden] and stacked experts [experts, out, in]."""
    n, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    p = f"model.layers.{layer}.mlp."
    return {
        p + "gate.weight": (n, hidden),
        p + "switch_mlp.gate_proj.weight": (n, inter, hidden),
        p + "switch_mlp.up_proj.weight": (n, inter, hidden),
        p + "switch_mlp.down_proj.weight": (n, hidden, inter),
    }


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


def check_shard_name(index: Path, tensor: str, name: str) -> None:
    """A shard must be a file in the checkpoint directory: a relative path that never goes up
    (`..`). A symlink inside the directory is followed: the Hugging Face cache links every
    file of a snapshot to its blobs folder."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(
            f"{index}: weight_map puts {tensor} in {name!r}, outside the checkpoint directory "
            "(a shard must be a file in it)"
        )


def check_vocabulary(tokenizer: Tokenizer, config: Qwen3Config, path: Path) -> None:
    """Every token id must have a row in the embedding: an id past vocab_size would read
    nothing meaningful (MLX does not check indices)."""
    top = max(tokenizer.hf_tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= config.vocab_size:
        raise CheckpointError(
            f"{path / 'tokenizer.json'}: the tokenizer has token ids up to {top}, but "
            f"config.json's vocab_size is {config.vocab_size}: ids {config.vocab_size}..{top} "
            "have no row in the embedding"
        )


def check_finite(
    weights: dict[str, mx.array], path: Path, files: dict[str, Path] | None = None
) -> None:
    """NaN or inf in a weight spreads to every activation after it, and the model prints
    noise. A sum is NaN or inf when one of its terms is, and it is several times faster than
    isfinite(w).all() on a CPU; summed in float32, a large float16 tensor cannot overflow.
    One sum per floating-point tensor (quantized codes are uint32, and a tied head is the
    embedding), FINITE_BATCH tensors per evaluation; the weights stay loaded, as the model
    needs them anyway."""
    tensors: dict[int, tuple[str, mx.array]] = {}
    for name, w in weights.items():
        if mx.issubdtype(w.dtype, mx.floating):
            tensors.setdefault(id(w), (name, w))
    named = list(tensors.values())
    for start in range(0, len(named), FINITE_BATCH):
        batch = named[start : start + FINITE_BATCH]
        sums = mx.stack([w.astype(mx.float32).sum() for _, w in batch])
        finite = mx.isfinite(sums).tolist()
        for (name, w), ok in zip(batch, finite):
            if not ok:
                raise CheckpointError(
                    f"{(files or {}).get(name, path)}: tensor {name} holds NaN or infinite "
                    f"values (read as {dtype_name(w.dtype)}): the model would compute noise"
                )


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
        if len(shape) >= 2 and (f"{layer}.scales" in weights or weights[name].dtype == mx.uint32):
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
    scales and biases [O, I / group_size], with group_size and bits from config.json (a stack
    of experts' weights: [experts, O, ...] alike)."""
    fmt = config.quantization.of(layer) if config.quantization is not None else None
    if fmt is None:
        raise CheckpointError(
            f"{where(layer + '.weight')}: tensor {layer}.weight is quantized (uint32 codes or "
            f"a {layer}.scales tensor), but config.json's quantization entry does not cover it"
        )
    group_size, bits = fmt
    *rows, cols = shape
    if cols % group_size != 0:
        raise CheckpointError(
            f"{where(layer + '.weight')}: {layer} has {cols} inputs, not a multiple of "
            f"group_size {group_size}"
        )
    packed = {
        "weight": (*rows, cols * bits // 32),
        "scales": (*rows, cols // group_size),
        "biases": (*rows, cols // group_size),
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

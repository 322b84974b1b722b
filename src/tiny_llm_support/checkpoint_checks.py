"""What a Qwen3 checkpoint must hold, and the checks load_checkpoint runs on what it read: every
tensor with its shape (expected_shapes), shard names that stay in the directory, token ids within
the vocabulary, each weight's shape and dtype (a quantized layer's in its packed layout), and no
NaN or inf. Each failure is a CheckpointError that names the file at fault.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath

import mlx.core as mx

from .checkpoint_files import CheckpointError
from .config import Qwen3Config
from .tokenizer import Tokenizer

FINITE_BATCH = 32  # tensors per evaluation of the NaN/inf check


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

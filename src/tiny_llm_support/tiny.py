"""Synthetic Qwen3 checkpoints in Hugging Face layout: tiny ones for tests and offline demos,
and random weights of any Qwen3 shape for benchmarks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import tokenizers

from .checkpoint import (
    EXPERT_PROJECTIONS,
    INDEX_FILE,
    SINGLE_FILE,
    quantize_weights,
    to_mx_dtype,
)
from .checkpoint_checks import expected_shapes
from .config import Qwen3Config
from .quant_format import check_quant_format
from .tiny_tokenizer import tiny_tokenizer_config, tiny_tokenizer_json

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # deliberately not hidden_size // num_attention_heads
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}

# a tiny mixture of experts (Week 4 Day 6): every layer sparse, 2 of 8 experts per token
TINY_MOE_DEFAULTS: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def make_tiny_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a deterministic random Qwen3 checkpoint (config, weights, tokenizer) into `path`.

    Overrides replace config.json keys. Some are special: `shards=N` splits the weights into
    N files with an index, `rope_in_parameters=True` puts rope_theta in rope_parameters, and
    `quantize=4` (or 2, 8) writes the same weights in MLX's affine format with groups of
    `group_size` (default 64), the layout mlx-lm's convert writes: every linear layer and the
    embedding whose input size the group size divides, the others left in float.

    A mixture of experts (model_type "qwen3_moe", see make_tiny_moe_checkpoint) is written in
    Hugging Face's layout, one tensor per expert, or with `stacked_experts=True` (and always
    when quantized) in the stacked layout mlx-lm's convert writes.
    """
    shards = int(overrides.pop("shards", 1))
    stacked = bool(overrides.pop("stacked_experts", False))
    rope_in_parameters = bool(overrides.pop("rope_in_parameters", False))
    bits = overrides.pop("quantize", None)
    group_size = int(overrides.pop("group_size", 64))
    tokenizer_json = tiny_tokenizer_json()
    config = tiny_config(tokenizer_json, overrides)
    if rope_in_parameters:
        config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    if bits is not None:
        check_quant_format(group_size, int(bits), "make_tiny_checkpoint")
        fmt = {"group_size": group_size, "bits": int(bits), "mode": "affine"}
        config["quantization"] = config["quantization_config"] = fmt
    weights = random_weights(Qwen3Config.from_dict(config, source="make_tiny_checkpoint"), seed)
    if bits is not None:
        weights = quantize_weights(weights, group_size, int(bits))
    elif not stacked:
        weights = unstack_experts(weights)
    if not 1 <= shards <= len(weights):
        raise ValueError(f"shards must be between 1 and {len(weights)}, got {shards}")
    weights_format = "pt" if bits is None else "mlx"
    return write_checkpoint(path, config, weights, tokenizer_json, shards, weights_format)


def make_tiny_moe_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """make_tiny_checkpoint with TINY_MOE_DEFAULTS: a deterministic Qwen3-MoE checkpoint whose
    every layer routes each token to 2 of 8 experts (overrides as for make_tiny_checkpoint)."""
    return make_tiny_checkpoint(path, seed, **{**TINY_MOE_DEFAULTS, **overrides})


def unstack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Stacked experts (`mlp.switch_mlp.up_proj.weight` [experts, O, I]) as Hugging Face
    writes them: one tensor per expert (`mlp.experts.{j}.up_proj.weight` [O, I])."""
    out = {}
    for name, w in weights.items():
        prefix, _, rest = name.partition("mlp.switch_mlp.")
        if not rest or rest.split(".")[0] not in EXPERT_PROJECTIONS:
            out[name] = w
            continue
        out.update({f"{prefix}mlp.experts.{j}.{rest}": w[j] for j in range(w.shape[0])})
    return out


def write_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    tokenizer_json: str,
    shards: int = 1,
    weights_format: str = "pt",
) -> Path:
    """Write a checkpoint in Hugging Face layout, with the tiny tokenizer's config and template
    (`weights_format` is the safetensors metadata "format": "mlx" for quantized weights)."""
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(path)
    _write_json(path / "config.json", config)
    _write_weights(path, weights, shards, weights_format)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(path / "tokenizer_config.json", tiny_tokenizer_config())
    return path


def tiny_config(tokenizer_json: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json contents: TINY_DEFAULTS, the tokenizer's vocabulary and special ids, then
    `overrides`."""
    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if overrides.get("vocab_size", vocab) < vocab:
        raise ValueError(
            f"vocab_size={overrides['vocab_size']} is smaller than the tiny tokenizer's "
            f"vocabulary ({vocab} tokens)"
        )
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        **TINY_DEFAULTS,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_scaling": None,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
    }
    config.update(overrides)
    return config


def random_weights(
    config: Qwen3Config, seed: int, dtype: mx.Dtype | str = "float32"
) -> dict[str, mx.array]:
    """Deterministic random weights for every tensor of `config`, scaled so that next-token
    logits are far from uniform. A tied lm_head is left out, as in a published checkpoint.

    Embeddings have std 1 and projections std 1/sqrt(fan_in), so activations keep unit scale,
    except o_proj and down_proj, 3x larger: the layers' output then outweighs the token's own
    embedding in the residual stream (with tied embeddings, a model would otherwise just echo
    its input token). Norm weights are near 1; an untied lm_head has std 4/sqrt(hidden).
    Measured on random inputs: the top-1 minus top-2 logit gap has a median of about 0.8-2.
    """
    rng = np.random.RandomState(seed)
    target = to_mx_dtype(dtype)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        noise = rng.standard_normal(shape).astype(np.float32)
        weights[name] = mx.array(noise * _scale(name, shape, config) + _offset(name)).astype(target)
        mx.eval(weights[name])  # one tensor at a time: a large model never has two copies
    return weights


def _scale(name: str, shape: tuple[int, ...], config: Qwen3Config) -> np.float32:
    if name.endswith("norm.weight"):
        return np.float32(0.1)
    if name == "model.embed_tokens.weight":
        return np.float32(1.0)
    if name == "lm_head.weight":
        return np.float32(4.0 / math.sqrt(config.hidden_size))
    gain = 3.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
    return np.float32(gain / math.sqrt(shape[-1]))  # projections: gain / sqrt(fan_in)


def _offset(name: str) -> np.float32:
    return np.float32(1.0 if name.endswith("norm.weight") else 0.0)


def _write_weights(path: Path, weights: dict[str, mx.array], shards: int, fmt: str) -> None:
    metadata = {"format": fmt}
    if shards == 1:
        mx.save_safetensors(str(path / SINGLE_FILE), weights, metadata=metadata)
        return
    names = list(weights)
    weight_map = {}
    for k, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {names[i]: weights[names[i]] for i in part}
        mx.save_safetensors(str(path / file), chunk, metadata=metadata)
        weight_map.update(dict.fromkeys(chunk, file))
    total = sum(w.nbytes for w in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(path / INDEX_FILE, index)


def _remove_old_weights(path: Path) -> None:
    """Drop weight files of an earlier tiny checkpoint here, so a stale index cannot win."""
    for old in [path / SINGLE_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

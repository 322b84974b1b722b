"""Loading Qwen3 checkpoints in Hugging Face layout (safetensors only, never pickle)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .config import Qwen3Config
from .tokenizer import Tokenizer, load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


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


def to_mx_dtype(dtype: mx.Dtype | str) -> mx.Dtype:
    """Accept an mx dtype or one of "float32", "bfloat16", "float16"."""
    if isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_checkpoint(path: str | Path, dtype: mx.Dtype | str | None = None) -> Checkpoint:
    """Load config.json, the safetensors weights (single file or sharded) and the tokenizer."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config = Qwen3Config.from_file(path / "config.json")
    target = to_mx_dtype(dtype) if dtype is not None else None
    weights: dict[str, mx.array] = {}
    for file in safetensors_files(path):
        weights.update(mx.load(str(file)))
    _tie_lm_head(weights, config, path)
    check_weights(weights, config, path)
    if target is not None:
        weights = _convert(weights, target)
    tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return Checkpoint(path=path, config=config, weights=weights, tokenizer=tokenizer)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the shard index names, else model.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} names {file.name}, which does not exist")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{pickles[0]} is a PyTorch pickle file; only safetensors checkpoints are supported "
            "(pickle files can run arbitrary code when loaded)"
        )
    raise FileNotFoundError(f"no *.safetensors weight files in {path}")


def check_weights(weights: dict[str, mx.array], config: Qwen3Config, path: Path) -> None:
    """Every expected tensor must be present with the expected shape; extras are ignored."""
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise ValueError(f"{path}: tensor {name} is missing (expected shape {list(shape)})")
        got = tuple(weights[name].shape)
        if got != shape:
            raise ValueError(f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)}")


def _tie_lm_head(weights: dict[str, mx.array], config: Qwen3Config, path: Path) -> None:
    if "lm_head.weight" in weights:
        return
    if not config.tie_word_embeddings:
        raise ValueError(
            f"{path}: tensor lm_head.weight is missing and tie_word_embeddings is false"
        )
    if "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]


def _convert(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Cast every floating-point weight; a tied lm_head stays the same array as the embedding."""
    converted = {}
    for name, w in weights.items():
        converted[name] = w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w
    if weights.get("lm_head.weight") is weights.get("model.embed_tokens.weight"):
        converted["lm_head.weight"] = converted["model.embed_tokens.weight"]
    return converted

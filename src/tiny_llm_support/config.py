"""The Qwen3 model configuration, parsed from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint_files import CheckpointError, read_json_object

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
    "max_position_embeddings",
)

# MLX's affine format as tiny-llm reads it: codes of these widths pack evenly into a uint32,
# and these are the group sizes mx.quantize accepts.
QUANT_BITS = (2, 4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def check_quant_format(group_size: int, bits: int, source: str | Path) -> None:
    """A clear error for a group size or bit width outside MLX's affine format."""
    if group_size not in QUANT_GROUP_SIZES:
        raise ValueError(
            f"{source}: group_size must be one of {QUANT_GROUP_SIZES}, got {group_size}"
        )
    if bits not in QUANT_BITS:
        raise ValueError(f"{source}: bits must be one of {QUANT_BITS}, got {bits}")


@dataclass(frozen=True)
class Quantization:
    """config.json's `quantization` entry, as mlx-lm's convert writes it: one group size and
    bit width for the whole model, and optionally per layer ("model.layers.0.mlp.down_proj")
    its own, or False for a layer left in float. Which layers are quantized is decided by
    the tensors: a layer is quantized when the checkpoint has its `.scales`."""

    group_size: int
    bits: int
    layers: tuple[tuple[str, tuple[int, int] | None], ...] = ()

    def of(self, layer: str) -> tuple[int, int] | None:
        """(group_size, bits) of a layer, or None where the config leaves it in float."""
        return dict(self.layers).get(layer, (self.group_size, self.bits))


@dataclass(frozen=True)
class Qwen3Config:
    """The hyper-parameters of a Qwen3 checkpoint (`raw` keeps the whole config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    quantization: Quantization | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | Path = "config.json") -> Qwen3Config:
        """Parse a config dict; `source` names the file in error messages, which are
        CheckpointErrors."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls._parse(d, source)
        except (AttributeError, TypeError, ValueError) as e:  # an entry of the wrong kind
            if isinstance(e, CheckpointError):
                raise
            detail = str(e).removeprefix(f"{source}: ")
            raise CheckpointError(f"{source}: {detail}") from None

    @classmethod
    def _parse(cls, d: dict[str, Any], source: str | Path) -> Qwen3Config:
        model_type = d.get("model_type")
        if model_type != "qwen3":
            raise CheckpointError(
                f"{source}: model_type is {model_type!r}, but only 'qwen3' checkpoints are "
                "supported"
            )
        for key in _REQUIRED:
            if key not in d:
                raise CheckpointError(f"{source}: required key {key!r} is missing")
        number = lambda key, kind=int: _number(d, key, kind, source)
        heads = number("num_attention_heads")
        if heads <= 0:
            raise CheckpointError(f"{source}: num_attention_heads must be positive, got {heads}")
        config = cls(
            vocab_size=number("vocab_size"),
            hidden_size=number("hidden_size"),
            intermediate_size=number("intermediate_size"),
            num_hidden_layers=number("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=number("num_key_value_heads")
            if d.get("num_key_value_heads")
            else heads,
            head_dim=number("head_dim") if d.get("head_dim") else number("hidden_size") // heads,
            rms_norm_eps=number("rms_norm_eps", float),
            rope_theta=_rope_theta(d, source),
            max_position_embeddings=number("max_position_embeddings"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            quantization=_quantization(d, source),
            raw=dict(d),
        )
        config._check(source)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> Qwen3Config:
        """Read and parse a config.json file."""
        path = Path(path)
        return cls.from_dict(read_json_object(path, "a JSON object of model settings"), path)

    def _check(self, source: str | Path) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
        }
        for key, value in sizes.items():
            if value <= 0:
                raise CheckpointError(f"{source}: {key} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise CheckpointError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )


def _number(d: dict[str, Any], key: str, kind: type, source: str | Path) -> Any:
    """d[key] as an int or a float, or an error naming the key and the file."""
    try:
        return kind(d[key])
    except (TypeError, ValueError):
        raise CheckpointError(f"{source}: {key} must be a number, got {d[key]!r}") from None


def _rope_theta(d: dict[str, Any], source: str | Path) -> float:
    """rope_theta sits at the top level (older configs) or in rope_parameters (newer ones)."""
    if "rope_theta" in d:
        return _number(d, "rope_theta", float, source)
    params = d.get("rope_parameters") or {}
    if "rope_theta" in params:
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise CheckpointError(
                f"{source}: rope_type {rope_type!r} is not supported, only 'default'"
            )
        return _number(params, "rope_theta", float, source)
    raise CheckpointError(
        f"{source}: required key 'rope_theta' is missing (top level or rope_parameters)"
    )


def _quantization(d: dict[str, Any], source: str | Path) -> Quantization | None:
    """MLX's affine format (a `quantization` entry); other quantized formats are refused."""
    entry = d.get("quantization")
    if entry is None:
        other = d.get("quantization_config")
        if other:
            method = other.get("quant_method") if isinstance(other, dict) else None
            raise CheckpointError(
                f"{source}: quantization_config (quant_method {method!r}) is not supported; "
                "tiny-llm reads MLX's affine format, the `quantization` entry mlx-lm's "
                "convert writes"
            )
        return None
    group_size, bits = _quant_format(entry, source, "quantization")
    layers = []
    for key, value in sorted(entry.items()):
        if isinstance(value, dict):
            layers.append((key, _quant_format(value, source, f"quantization.{key}")))
        elif value is False:
            layers.append((key, None))
    return Quantization(group_size, bits, tuple(layers))


def _quant_format(entry: dict[str, Any], source: str | Path, where: str) -> tuple[int, int]:
    mode = entry.get("mode", "affine")
    if mode != "affine":
        raise CheckpointError(f"{source}: {where} has mode {mode!r}; only 'affine' is supported")
    for key in ("group_size", "bits"):
        if key not in entry:
            raise CheckpointError(f"{source}: {where} has no {key!r}")
    group_size, bits = int(entry["group_size"]), int(entry["bits"])
    check_quant_format(group_size, bits, f"{source}: {where}")
    return group_size, bits

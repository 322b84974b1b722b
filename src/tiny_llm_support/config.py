"""The Qwen3 model configuration, parsed from a Hugging Face `config.json` (its `quantization`
entry into quant_format.Quantization)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint_files import CheckpointError, read_json_object
from .quant_format import Quantization, check_quant_format

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
    "max_position_embeddings",
)

_REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
MODEL_TYPES = ("qwen3", "qwen3_moe")

# Keys transformers 5 writes under another name than transformers 4 did, to the name read
# here (v4's): Qwen3MoeConfig's attribute_map saves num_experts as num_local_experts, and
# PreTrainedConfig saves torch_dtype as dtype. (v5 also folds rope_theta and rope_scaling
# into rope_parameters; _rope_theta reads both forms.)
_V5_NAMES = {"num_local_experts": "num_experts", "dtype": "torch_dtype"}


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
    # a mixture of experts (model_type "qwen3_moe", Week 4 Day 6); num_experts 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # sliding-window attention (Week 4 Day 7): the window of each layer, None for full attention
    layer_windows: tuple[int | None, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def window(self, layer: int) -> int | None:
        """How many positions layer `layer` attends over (the query's own and the W - 1 before
        it), or None when it sees every earlier position."""
        return self.layer_windows[layer] if self.layer_windows else None

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` holds a mixture of experts instead of the dense MLP: every
        decoder_sparse_step-th layer (the 1st, 2nd, ... counted from 1) not in mlp_only_layers,
        the rule of transformers' and mlx-lm's Qwen3-MoE."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

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
        if model_type not in MODEL_TYPES:
            raise CheckpointError(
                f"{source}: model_type is {model_type!r}, but only 'qwen3' and 'qwen3_moe' "
                "checkpoints are supported"
            )
        raw, d = d, _v4_names(d, source)  # raw: the file as it is; d: read with v4's names
        required = _REQUIRED + (_REQUIRED_MOE if model_type == "qwen3_moe" else ())
        for key in required:
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
            torch_dtype=str(d.get("torch_dtype") or "float32"),
            quantization=_quantization(d, source),
            **(_experts(d, source) if model_type == "qwen3_moe" else {}),
            layer_windows=_layer_windows(d, source),
            raw=dict(raw),
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
            **(
                {
                    "num_experts": self.num_experts,
                    "moe_intermediate_size": self.moe_intermediate_size,
                    "decoder_sparse_step": self.decoder_sparse_step,
                }
                if self.raw.get("model_type") == "qwen3_moe"
                else {}
            ),
        }
        for key, value in sizes.items():
            if value <= 0:
                raise CheckpointError(f"{source}: {key} must be positive, got {value}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(
                f"{source}: num_experts_per_tok must be between 1 and num_experts "
                f"({self.num_experts}), got {self.num_experts_per_tok}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise CheckpointError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        _check_bounds(self, source)


def _number(d: dict[str, Any], key: str, kind: type, source: str | Path) -> Any:
    """d[key] as an int or a float, or an error naming the key and the file."""
    try:
        value = kind(d[key])
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(1e400)
        raise CheckpointError(f"{source}: {key} must be a number, got {d[key]!r}") from None
    if kind is int and isinstance(d[key], float) and not d[key].is_integer():
        raise CheckpointError(f"{source}: {key} must be a whole number, got {d[key]!r}")
    return value


def _v4_names(d: dict[str, Any], source: str | Path) -> dict[str, Any]:
    """d with the keys of _V5_NAMES under their transformers 4 names; a config that has both
    spellings of one setting with different values is refused (null counts as absent)."""
    d = dict(d)
    for new, old in _V5_NAMES.items():
        value = d.pop(new, None)
        if value is None:
            continue
        if d.get(old) is not None and d[old] != value:
            raise CheckpointError(
                f"{source}: {new} ({value!r}, transformers 5's name) and {old} ({d[old]!r}, "
                "transformers 4's) disagree"
            )
        d[old] = value
    return d


def _layer_windows(d: dict[str, Any], source: str | Path) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers reads a Qwen3 config: only with
    use_sliding_window true, on the layers that layer_types calls "sliding_attention", or
    without layer_types on the layers from max_window_layers on; () when no layer has one."""
    if not d.get("use_sliding_window"):
        return ()
    window = d.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointError(
            f"{source}: use_sliding_window is true, so sliding_window must be a positive "
            f"number of positions, got {window!r}"
        )
    layers = _number(d, "num_hidden_layers", int, source)
    if layers > BOUNDS["num_hidden_layers"][0]:
        return ()  # _check_bounds refuses it, before anything is built per layer
    kinds = d.get("layer_types")
    if kinds is None:
        first = _number(d, "max_window_layers", int, source) if "max_window_layers" in d else 28
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    known = ("full_attention", "sliding_attention")
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= set(known):
        raise CheckpointError(
            f"{source}: layer_types must list one of {known} for each of the {layers} layers"
        )
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(windows) else ()


def _experts(d: dict[str, Any], source: str | Path) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe config."""
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError(f"{source}: mlp_only_layers must be a list of layer numbers")
    return {
        "num_experts": _number(d, "num_experts", int, source),
        "num_experts_per_tok": _number(d, "num_experts_per_tok", int, source),
        "moe_intermediate_size": _number(d, "moe_intermediate_size", int, source),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "decoder_sparse_step": _number(d, "decoder_sparse_step", int, source)
        if "decoder_sparse_step" in d
        else 1,
        "mlp_only_layers": tuple(only),
    }


def _rope_theta(d: dict[str, Any], source: str | Path) -> float:
    """RoPE's base. transformers 4 writes rope_theta at the top level and rope_scaling (null
    for plain RoPE); transformers 5 puts both in rope_parameters. Only plain RoPE (rope_type
    "default", or v4's spelling "type") is supported, and both rope_thetas must agree."""
    for key in ("rope_scaling", "rope_parameters"):
        params = d.get(key) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(
                f"{source}: rope_type {rope_type!r} ({key}) is not supported, only 'default'"
            )
    params = d.get("rope_parameters") or {}
    thetas = [_number(c, "rope_theta", float, source) for c in (d, params) if "rope_theta" in c]
    if not thetas:
        raise CheckpointError(
            f"{source}: required key 'rope_theta' is missing (top level or rope_parameters)"
        )
    if len(thetas) == 2 and thetas[0] != thetas[1]:
        raise CheckpointError(
            f"{source}: rope_theta ({thetas[0]}) and rope_parameters.rope_theta ({thetas[1]}) "
            "disagree"
        )
    return thetas[0]


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


# Upper bounds, checked at parse time, before anything is sized by these values: the loader
# lists the expected tensors layer by layer and expert by expert, and the RoPE tables hold an
# angle for every position. Real Qwen3 checkpoints stay far below them.
BOUNDS = {
    "num_hidden_layers": (1024, "layers"),
    "num_experts": (4096, "experts"),
    "max_position_embeddings": (2**20, "positions (the RoPE tables hold every one)"),
}


def _check_bounds(config: Qwen3Config, source: str | Path) -> None:
    """A clear error for a size no checkpoint could have (`num_hidden_layers: 1e9`), and for
    a norm epsilon or RoPE base that is not a positive finite number (NaN or inf would load
    and compute garbage)."""
    for key, (limit, what) in BOUNDS.items():
        value = getattr(config, key)
        if value > limit:
            raise CheckpointError(
                f"{source}: {key} is {value}, more than tiny-llm takes: at most {limit} {what}"
            )
    for key in ("rms_norm_eps", "rope_theta"):
        value = getattr(config, key)
        if not 0 < value < float("inf"):  # also refuses NaN
            raise CheckpointError(f"{source}: {key} must be a positive finite number, got {value}")

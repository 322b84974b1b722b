"""The models a benchmark runs: "tiny", a shortcut with an embedded config (random weights,
no download), a checkpoint directory or a config.json, as a `BenchModel` any process can build.

`resolve_bench_model` reads only what describes the model; `BenchModel.materialize` writes
random weights once, so that every fresh run only loads them (`load_weights`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benches.harness.progress import log
from tiny_llm_support import (
    SHORTCUTS,
    Checkpoint,
    Qwen3Config,
    Tokenizer,
    expected_shapes,
    load_checkpoint,
    load_tokenizer,
    random_weights,
    resolve_model,
)
from tiny_llm_support.checkpoint import safetensors_files
from tiny_llm_support.checkpoint_files import check_safetensors, read_json_object

__all__ = [
    "EMBEDDED_CONFIGS", "BenchModel", "resolve_bench_model", "model_slug", "slug",
    "load_weights", "write_random_weights",
]  # fmt: skip

# The published config.json of the Qwen3 checkpoints the benchmarks use most, so that
# `--model qwen3-0.6b` works offline with random weights. Token ids from 151643
# (<|endoftext|>) up are control tokens in the Qwen3 vocabulary.
_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}
EMBEDDED_CONFIGS: dict[str, dict[str, Any]] = {
    name: {**_QWEN3_COMMON, "hidden_size": hidden, "intermediate_size": 3 * hidden,
           "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128}
    for name, hidden in (("qwen3-0.6b", 1024), ("qwen3-1.7b", 2048))
}  # fmt: skip
_QWEN3_FIRST_CONTROL_ID = 151643


@dataclasses.dataclass
class BenchModel:
    """A model a benchmark can build in any process: where it comes from and its shape.

    `config` is the config.json dict actually used (num_hidden_layers already overridden).
    `path` is a checkpoint directory (real weights, or random ones after `materialize`);
    None for random weights not written yet. `token_ids` is the half-open range
    [low, high) of ordinary token ids and `excluded_ids` the special ones inside it, from
    which synthetic prompts may be drawn.
    """

    name: str
    source: str  # "tiny", "embedded-config", "config-file", "checkpoint", "hub"
    config: dict[str, Any]
    random_weights: bool
    num_layers: int
    original_num_layers: int
    weight_seed: int
    path: str | None
    token_ids: tuple[int, int]
    excluded_ids: list[int]

    @property
    def qwen3_config(self) -> Qwen3Config:
        return Qwen3Config.from_dict(self.config, source=f"config of {self.name}")

    def parameter_count(self) -> int:
        """Parameters as the model computes with them (a tied head counted once)."""
        cfg = self.qwen3_config
        shapes = expected_shapes(cfg)
        if cfg.tie_word_embeddings:
            shapes.pop("lm_head.weight")
        return sum(math.prod(s) for s in shapes.values())

    def log_line(self) -> str:
        """The model in a line of the log: name, source, layers, parameters, weights."""
        weights = "random" if self.random_weights else "checkpoint"
        return (
            f"{self.name} ({self.source}, {self.num_layers} layers, "
            f"{self.parameter_count() / 1e6:.1f}M parameters, {weights} weights)"
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "path": self.path if not self.random_weights else None,
            "random_weights": self.random_weights,
            "weight_seed": self.weight_seed if self.random_weights else None,
            "num_layers": self.num_layers,
            "original_num_layers": self.original_num_layers,
            "parameters": self.parameter_count(),
            "prompt_token_ids": {
                "low": self.token_ids[0],
                "high": self.token_ids[1],
                "excluded": self.excluded_ids,
            },
            "config": self.config,
        }

    def materialize(self, directory: str | Path, dtype: str) -> None:
        """For random weights: write config.json and model.safetensors into `directory`
        (once, in the parent), so that each fresh process only has to load them."""
        if not self.random_weights:
            return
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights = random_weights(self.qwen3_config, self.weight_seed, dtype)
        mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "pt"})
        (directory / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        del weights
        mx.clear_cache()
        self.path = str(directory)

    def load(self, dtype: str) -> Checkpoint:
        """The checkpoint with this model's weights, cast to `dtype`, cut to `num_layers`."""
        if self.path is None:  # random weights, built in this process
            cfg = self.qwen3_config
            weights = random_weights(cfg, self.weight_seed, dtype)
            if cfg.tie_word_embeddings:
                weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
            return Checkpoint(path=Path(f"<random {self.name}>"), config=cfg, weights=weights)
        ckpt = load_checkpoint(self.path, dtype=dtype)
        if ckpt.config.num_hidden_layers != self.num_layers:
            cut = dataclasses.replace(
                ckpt.config, num_hidden_layers=self.num_layers, raw=dict(self.config)
            )
            ckpt = Checkpoint(ckpt.path, cut, ckpt.weights, ckpt.tokenizer)
        return ckpt

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchModel:
        d = dict(d)
        d["token_ids"] = tuple(d["token_ids"])
        return cls(**d)


def resolve_bench_model(
    model: str,
    random: bool | None = None,
    num_layers: int | None = None,
    weight_seed: int = 0,
    offline: bool | None = None,
) -> BenchModel:
    """Read only what describes the model (config, tokenizer); no weights are loaded.

    model: "tiny", a shortcut (qwen3-0.6b, ...), a checkpoint directory, a config.json path
    or a Hugging Face repo id. random: None picks random weights for shortcuts with an
    embedded config and for config.json paths, the checkpoint's own weights otherwise.
    Raises ValueError for a combination that cannot work.
    """
    key = model.lower()
    path = Path(model).expanduser()
    tokenizer: Tokenizer | None = None
    checkpoint_dir: Path | None = None
    if key in EMBEDDED_CONFIGS and not path.exists():
        random = True if random is None else random
        if random:
            source, config = "embedded-config", dict(EMBEDDED_CONFIGS[key])
        else:
            source, checkpoint_dir = "hub", resolve_model(key, offline=offline)
    elif path.is_file():
        if random is False:
            raise ValueError(f"{model} is a config file: it only works with random weights")
        random, source, config = True, "config-file", _read_config(path)
    elif path.is_dir() or key == "tiny":
        checkpoint_dir = resolve_model(model)
        source = "tiny" if key == "tiny" else "checkpoint"
        random = bool(random)
    elif key in SHORTCUTS or model.count("/") == 1:
        if random:
            raise ValueError(
                f"there is no embedded config for {model} (only for "
                f"{', '.join(EMBEDDED_CONFIGS)}); pass the path of its config.json instead"
            )
        random, source, checkpoint_dir = False, "hub", resolve_model(model, offline=offline)
    else:
        raise ValueError(
            f"unknown model {model!r}: use tiny, {', '.join(EMBEDDED_CONFIGS)}, another "
            "shortcut, a checkpoint directory, or the path of a config.json"
        )
    if checkpoint_dir is not None:
        config = _read_config(checkpoint_dir / "config.json")
        if (checkpoint_dir / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(checkpoint_dir)
        if not random:
            for file in safetensors_files(checkpoint_dir):
                check_safetensors(file)  # here, before a run would find it truncated

    original = int(config["num_hidden_layers"])
    layers = original if num_layers is None else num_layers
    if layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {layers}")
    if not random and layers > original:
        raise ValueError(
            f"{model} has {original} layers; --num-layers {layers} needs random weights"
        )
    config = {**config, "num_hidden_layers": layers}
    Qwen3Config.from_dict(config, source=model)  # a bad config fails here, in the parent
    low, high, excluded = _ordinary_token_ids(config, tokenizer)
    return BenchModel(
        name=model,
        source=source,
        config=config,
        random_weights=bool(random),
        num_layers=layers,
        original_num_layers=original,
        weight_seed=weight_seed,
        path=None if random else str(checkpoint_dir),
        token_ids=(low, high),
        excluded_ids=excluded,
    )


def _read_config(path: Path) -> dict[str, Any]:
    return read_json_object(path, "a JSON object of model settings")


def _ordinary_token_ids(
    config: dict[str, Any], tokenizer: Tokenizer | None
) -> tuple[int, int, list[int]]:
    """[low, high) and the special ids inside it: where synthetic prompt ids may come from."""
    vocab = int(config["vocab_size"])
    special: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        special.update(value if isinstance(value, list) else [value] if value is not None else [])
    high = vocab
    if tokenizer is not None:
        high = min(vocab, tokenizer.vocab_size)  # embedding rows past the tokenizer are padding
        special.update(tokenizer.hf_tokenizer.get_added_tokens_decoder())
        special.update(tokenizer.eos_token_ids)
    elif config.get("model_type") == "qwen3" and vocab > _QWEN3_FIRST_CONTROL_ID:
        high = _QWEN3_FIRST_CONTROL_ID
    excluded = sorted(i for i in special if 0 <= i < high)
    if high - len(excluded) < 1:
        raise ValueError("the vocabulary has no ordinary token ids to draw prompts from")
    return 0, high, excluded


def model_slug(model: BenchModel) -> str:
    """The model in a result file's name: a shortcut's name, or a checkpoint's (or config
    file's) folder, lower case, other characters than letters, digits and dots as -."""
    name = Path(model.name).name if model.source in ("checkpoint", "config-file") else model.name
    if name == "config.json":
        name = Path(model.name).parent.name or "config"
    return slug(name) or "model"


def slug(name: str) -> str:
    """`name` in a file name: lower case, every run of other characters than letters, digits
    and dots one -."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-").lower()


def load_weights(model: dict[str, Any], dtype: str) -> tuple[BenchModel, Checkpoint]:
    """In a run's fresh process: the BenchModel of a spec (BenchModel.to_dict) and its
    checkpoint in `dtype`, every weight read now (mx.load is lazy: not inside a timed run)."""
    bench_model = BenchModel.from_dict(model)
    ckpt = bench_model.load(dtype)
    mx.eval(list(ckpt.weights.values()))
    return bench_model, ckpt


def write_random_weights(model: BenchModel, tmp: Path, dtype: str) -> None:
    """For a model with random weights: write them once, into tmp/weights, so that every run
    only loads them (BenchModel.materialize); says how long it took."""
    if model.random_weights:
        t = time.perf_counter()
        model.materialize(tmp / "weights", dtype)
        log(f"random weights written in {time.perf_counter() - t:.1f} s")

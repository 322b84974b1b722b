"""Helpers shared by the benchmarks in benches/.

- Models: `resolve_bench_model` turns "tiny", a shortcut ("qwen3-0.6b"), a checkpoint directory
  or a config.json path into a `BenchModel`; shortcuts with an embedded config need no
  download, since their weights can be random (same shapes, so the same FLOPs and bytes moved).
  `BenchModel.materialize(dir)` writes a random-weight checkpoint once, so that every fresh
  benchmark process only loads it; `BenchModel.load(dtype)` builds the `Checkpoint`. Random
  weights come from tiny_llm_support.random_weights, the generator of the tiny checkpoints.
- The command line: `bench_parser`; `add_model_arguments` and `bench_model_from_args` are the
  "model" group; `bench_model_or_exit` resolves a --model of a bench without that group;
  `add_output_arguments` and `set_output_paths` are --json-output (and --plot-output).
- The machine: `host_info()`, `mlx_info()`, `blas_info()`, `openblas_preload_env()`, and the
  BLAS the runs in fresh processes get (`runs_environment`, `log_runs_blas`, `runs_blas`).
- Numbers: `percentile`, `summarize`, `median`, `least`, `greatest`.
- Runs in fresh processes: `plan_runs` (the order), `run_fresh` (one run, in the parent);
  `child_errors`, `load_weights` and `planned_run` in the run's own process.
- Output: `check_outputs` (before the run: every path it will write can be written),
  `write_json` and `replace_file` (whole files through a rename, saying when one is replaced),
  `report_start` (the fields every report starts with), `write_report`, `pyplot` and
  `save_figure` (plots), `columns` (text tables), `log` (progress, to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from tiny_llm_support import (
    SHORTCUTS,
    Checkpoint,
    Qwen3Config,
    Tokenizer,
    blas_info,
    expected_shapes,
    gpu_available,
    load_checkpoint,
    load_tokenizer,
    openblas_preload_env,
    random_weights,
    reexec_with_openblas,
    resolve_model,
)
from tiny_llm_support.checkpoint import safetensors_files
from tiny_llm_support.checkpoint_files import CheckpointError, check_safetensors, read_json_object
from tiny_llm_support.cli import (
    DEVICES,
    DTYPES,
    SOLUTIONS,
    add_solution_argument,
    default_dtype,
    int_at_least,
    unfinished_message,
)

RESULTS = Path(__file__).resolve().parent / "results"  # where the benchmarks write JSON

__all__ = [
    # models
    "RESULTS", "EMBEDDED_CONFIGS", "BenchModel", "resolve_bench_model",
    # the command line
    "bench_parser", "add_model_arguments", "bench_model_from_args", "bench_model_or_exit",
    "check_checkpoint_arg", "add_output_arguments", "set_output_paths", "arguments_json",
    # the machine
    "OLD_OPENBLAS_CORES", "BLAS_VARIABLES", "host_info", "host_slug", "mlx_info", "blas_info",
    "device_name", "package_version", "environment", "openblas_core", "process_blas",
    "openblas_hint", "log_blas", "openblas_preload_env", "restart_with_openblas",
    "runs_environment",
    "runs_openblas_core", "probe_openblas_core", "log_runs_blas", "runs_blas", "memory_bytes",
    # numbers
    "percentile", "median", "least", "greatest", "summarize", "first_difference",
    "agreement_summary",
    # runs in fresh processes
    "EXIT_REPORTED", "plan_runs", "add_repeats_argument", "add_child_spec_argument",
    "write_random_weights", "run_fresh", "parse_args_or_run", "child_errors",
    "load_weights", "planned_run",
    # output
    "log", "canonical_json", "canonical_sha256", "check_outputs", "output_problem",
    "replace_file", "write_json", "relative_path", "model_slug", "slug", "log_model",
    "report_start", "runs_settings", "write_report", "pyplot", "save_figure", "columns",
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
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    "qwen3-1.7b": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
_QWEN3_FIRST_CONTROL_ID = 151643


# --- models ----------------------------------------------------------------------------


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


# --- the command line --------------------------------------------------------------------


def bench_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its name, what it does, and every option's default in --help."""
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def add_model_arguments(
    p: argparse.ArgumentParser, default_model: str, default_layers: int | None = None
) -> argparse._ArgumentGroup:
    """The "model" group every benchmark has (a bench adds its own options to it).
    default_layers: the --num-layers of a shortcut with an embedded config, when the bench
    cuts such a model (bench_model_from_args applies it)."""
    layers_help = "keep only this many layers (a smaller model; any number with random weights)"
    if default_layers is not None:
        layers_help += (
            f"; default: {default_layers} for a shortcut with an embedded config, "
            "all of them otherwise"
        )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=default_model,
        help="tiny, a shortcut (qwen3-0.6b, qwen3-1.7b: embedded config, random weights), a "
        "checkpoint directory, or the path of a config.json (random weights)",
    )
    m.add_argument(
        "--random-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random weights with the model's shapes (no download); default: on for "
        "shortcuts with an embedded config and config.json paths, off for checkpoints",
    )
    m.add_argument("--num-layers", type=int_at_least(1), default=None, help=layers_help)
    m.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weights and activations (default: float32 on the CPU, bfloat16 on a GPU)",
    )
    m.add_argument("--device", choices=DEVICES, default="auto")
    add_solution_argument(m)
    m.add_argument(
        "--offline",
        action="store_true",
        help="never download: real weights must be in the Hugging Face cache",
    )
    m.add_argument(
        "--no-openblas",
        action="store_true",
        help="on Linux, keep the mlx[cpu] wheel's bundled reference BLAS (no OpenBLAS preload)",
    )
    return m


def bench_model_from_args(
    p: argparse.ArgumentParser, args: argparse.Namespace, default_layers: int | None = None
) -> BenchModel:
    """The model group's checks and the model it names (no weights read); a bad choice exits
    through argparse, a checkpoint that cannot be read with one line. Fills in the defaults
    that depend on other options (set in args): --dtype from --device, and --num-layers
    `default_layers` for a shortcut with an embedded config. Also checks the output paths
    given (--json-output, --plot-output); a default one needs check_outputs of its own."""
    if args.num_layers is None and args.model.lower() in EMBEDDED_CONFIGS:
        args.num_layers = default_layers
    if args.device == "gpu" and not gpu_available():
        p.error("--device gpu: MLX has no Metal or CUDA device here")
    args.dtype = args.dtype or default_dtype(device_name(args.device))
    model = bench_model_or_exit(
        p, args.model, args.random_weights, args.num_layers, args.seed, args.offline or None
    )
    check_outputs(p, args.json_output, getattr(args, "plot_output", None))
    return model


def bench_model_or_exit(p: argparse.ArgumentParser, model: str, *args, **kwargs) -> BenchModel:
    """resolve_bench_model(model, ...), with a --model that names nothing usable as argparse's
    error and a checkpoint that cannot be read as one line (exit status 1)."""
    try:
        return resolve_bench_model(model, *args, **kwargs)
    except CheckpointError as e:  # not a usage error: the files are at fault
        raise SystemExit(f"error: {e}") from None
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        p.error(f"--model {model}: {e}")


def check_checkpoint_arg(p: argparse.ArgumentParser, model: str) -> None:
    """A --model that names no checkpoint is a usage error (status 2, one line with the names);
    one whose files are wrong is an error naming the file (status 1). Both before any run."""
    from tiny_llm_support.cli import model_path

    try:
        path = model_path(model)
    except ValueError as e:  # its first line names the problem; the rest lists the models
        names = ", ".join(["tiny", "tiny-random", *SHORTCUTS])
        p.error(f"--model: {str(e).splitlines()[0]} (one of {names}, a repo id or a directory)")
    try:
        load_checkpoint(path)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None


def add_output_arguments(group: argparse._ActionsContainer, json_name: str, plot: bool = False):
    """--json-output (default: benches/results/`json_name`, as the help says) and, for a bench
    that draws a plot, --plot-output and --no-plot."""
    group.add_argument(
        "--json-output", type=Path, default=None, help=f"default: benches/results/{json_name}"
    )
    if plot:
        group.add_argument(
            "--plot-output", type=Path, default=None, help="default: the JSON with .png"
        )
        group.add_argument("--no-plot", action="store_true")


def set_output_paths(p: argparse.ArgumentParser, args: argparse.Namespace, default_json: Path):
    """Fill in the output paths not given (the JSON: default_json; the plot, for a bench with
    --plot-output: the JSON's path with .png) and check them before the run, not after it."""
    if args.json_output is None:
        args.json_output = default_json
    plot = None
    if hasattr(args, "plot_output"):
        if args.plot_output is None:
            args.plot_output = args.json_output.with_suffix(".png")
        plot = None if args.no_plot else args.plot_output
    check_outputs(p, args.json_output, plot)


def arguments_json(args: argparse.Namespace, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    """The parsed arguments as JSON values (paths as strings), less those in `leave_out`."""
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in leave_out
    }


# --- the machine -------------------------------------------------------------------------

# OpenBLAS kernel sets that ran float32 matmuls several times slower than OPENBLAS_CORETYPE=
# SkylakeX on the course's machine: the old cores' generic kernels, and Debian's 0.3.21
# Cooperlake choice there (29 against 175 GFLOP/s for a 1024 x 1024 matmul, 2026-12-02)
OLD_OPENBLAS_CORES = (
    "Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Katmai", "Cooperlake",
)  # fmt: skip
# the environment variables that decide which BLAS runs, and how (recorded in the reports)
BLAS_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "LD_PRELOAD")


def host_info() -> dict[str, Any]:
    uname = platform.uname()
    return {
        "platform": platform.platform(),
        "system": uname.system,
        "machine": uname.machine,
        "processor": uname.processor or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "node": uname.node,
    }


def host_slug() -> str:
    """<os>-<arch>-<N>cpu, e.g. linux-x86_64-2cpu: this machine in a result file's name."""
    return f"{platform.system().lower()}-{platform.machine().lower()}-{os.cpu_count()}cpu"


def mlx_info() -> dict[str, Any]:
    """MLX's version and the default device of this process."""
    info: dict[str, Any] = {"version": mx.__version__, "default_device": str(mx.default_device())}
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return info


def device_name(requested: str) -> str:
    return "gpu" if requested == "gpu" or (requested == "auto" and gpu_available()) else "cpu"


def package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def environment(names: Sequence[str] = BLAS_VARIABLES) -> dict[str, str | None]:
    """The values of these environment variables in this process (None: not set)."""
    return {name: os.environ.get(name) for name in names}


def openblas_core() -> str | None:
    """The kernels OpenBLAS picked for this CPU, where this process runs on OpenBLAS. An
    OpenBLAS older than the CPU may not know it and fall back to old kernels (seen: Debian's
    0.3.21 chose "Prescott" on a Xeon with AVX-512, fp32 matmul about 5x slower than with
    OPENBLAS_CORETYPE=SkylakeX)."""
    import ctypes

    try:
        corename = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return None
    corename.restype = ctypes.c_char_p
    name = corename()
    return name.decode() if name else None


def process_blas() -> dict[str, Any]:
    """The BLAS this process runs on, with the kernels OpenBLAS picked (for a run's result)."""
    return {**blas_info(), "openblas_core": openblas_core()}


def openblas_hint(core: str | None) -> str | None:
    """The line that tells how to get faster kernels, when `core` (openblas_core) is one of
    OLD_OPENBLAS_CORES; None otherwise."""
    if core not in OLD_OPENBLAS_CORES:
        return None
    return (
        f"hint: OpenBLAS runs its {core} kernels, several times slower on this machine than "
        "the CPU allows (an OpenBLAS older than the CPU does not know it, or picks these): set "
        "OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2) for this command"
    )


def log_blas() -> str | None:
    """Print the BLAS this process runs on (and the hint when its kernels are old); return
    openblas_core()."""
    core = openblas_core()
    log(f"BLAS: {blas_info()['blas']}" + (f", OpenBLAS kernels {core}" if core else ""))
    if hint := openblas_hint(core):
        log(hint)
    return core


def restart_with_openblas(args: argparse.Namespace) -> None:
    """Unless --no-openblas: on Linux, restart this process with Debian's OpenBLAS preloaded,
    where it is installed and not loaded yet (tiny_llm_support.reexec_with_openblas, which
    returns only where no restart is needed). The processes it starts inherit it."""
    if not args.no_openblas:
        reexec_with_openblas()


def runs_environment(no_openblas: bool) -> tuple[dict[str, str], str | None]:
    """The environment of the runs in fresh processes, and the OpenBLAS library it preloads
    (None: nothing preloaded, or --no-openblas)."""
    return (dict(os.environ), None) if no_openblas else openblas_preload_env()


def runs_openblas_core(env: dict[str, str], preloaded: str | None) -> str | None:
    """The kernels OpenBLAS picks in the runs: probed with their environment where a library
    is preloaded, else this process's own."""
    return probe_openblas_core(env, preloaded) if preloaded else openblas_core()


def probe_openblas_core(env: dict[str, str], library: str | None) -> str | None:
    """The kernels the preloaded OpenBLAS would pick in the runs (a short process of its own,
    with the runs' environment); None where nothing is preloaded."""
    if library is None:
        return None
    code = (
        "import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).openblas_get_corename; "
        "f.restype = ctypes.c_char_p; print(f().decode())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, library], env=env, capture_output=True, text=True
    )
    return done.stdout.strip() or None if done.returncode == 0 else None


def log_runs_blas(preloaded: str | None, core: str | None = None) -> None:
    """Say which BLAS the runs get (and, where known, its kernels, with the hint when they are
    old ones)."""
    blas = f"OpenBLAS preloaded: {preloaded}" if preloaded else blas_info()["blas"]
    log(f"BLAS for the runs: {blas}")
    if core is not None:
        log(f"OpenBLAS kernels for the runs: {core}")
    if hint := openblas_hint(core):
        log(hint)


def runs_blas(
    runs: list[dict], env: dict[str, str], preloaded: str | None, core: str | None
) -> dict[str, Any]:
    """A report's "blas": this process's, the ones the runs said they ran on (process_blas),
    the kernels probed for them, and what the runs were started with."""
    return {
        "parent": blas_info(),
        "runs": sorted({run["blas"]["blas"] for run in runs}),
        "openblas_core_probed": core,
        "openblas_cores": sorted({c for run in runs if (c := run["blas"]["openblas_core"])}),
        "preloaded_by_bench": preloaded,
        "ld_preload": env.get("LD_PRELOAD"),
    }


def memory_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- numbers -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else None


def least(values: Iterable[float | None]) -> float | None:
    """The smallest value, None values left out (None when nothing is left)."""
    return min((v for v in values if v is not None), default=None)


def greatest(values: Iterable[float | None]) -> float | None:
    """The largest value, None values left out (None when nothing is left)."""
    return max((v for v in values if v is not None), default=None)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean, median, p95, max (each times `scale`, e.g. 1000 for seconds -> ms)."""
    if not values:
        return {"count": 0, "mean": None, "median": None, "p95": None, "max": None}
    return {
        "count": len(values),
        "mean": statistics.fmean(values) * scale,
        "median": percentile(values, 50) * scale,
        "p95": percentile(values, 95) * scale,
        "max": max(values) * scale,
    }


def first_difference(a: Sequence[Any], b: Sequence[Any], default: int | None) -> int | None:
    """The first position where two lists differ; `default` where one is a prefix of the
    other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), default)


def agreement_summary(checks: list[dict[str, Any]], rtol: float) -> dict[str, Any]:
    """A report's "agreement": the checks (each with its relative_diff and ok), the largest
    relative difference, and whether every check passed."""
    return {
        "rtol": rtol,
        "checks": checks,
        "largest_relative_diff": max((c["relative_diff"] for c in checks), default=0.0),
        "ok": all(c["ok"] for c in checks),
    }


# --- runs in fresh processes -------------------------------------------------------------

EXIT_REPORTED = 3  # a child stopped with a one-line error it printed itself


def plan_runs(items: Sequence[Any], repeats: int) -> list[tuple[int, str, Any]]:
    """(repeat, order, item) in launch order: repeat 0 forward, 1 reverse, 2 forward... so that
    no mode always runs first or last."""
    plan = []
    for r in range(repeats):
        order = "forward" if r % 2 == 0 else "reverse"
        for item in items if order == "forward" else list(reversed(items)):
            plan.append((r, order, item))
    return plan


def add_repeats_argument(group: argparse._ActionsContainer, what: str, default: int) -> None:
    """--repeats: fresh processes per `what` (a mode, a budget...), in plan_runs' order."""
    group.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=default,
        help=f"processes per {what}; every other repeat runs the {what}s in reverse order",
    )


def add_child_spec_argument(p: argparse.ArgumentParser) -> None:
    """The hidden --child-spec FILE that run_fresh starts a run with (parse_args_or_run)."""
    p.add_argument("--child-spec", help=argparse.SUPPRESS)


def write_random_weights(model: BenchModel, tmp: Path, dtype: str) -> None:
    """For a model with random weights: write them once, into tmp/weights, so that every run
    only loads them (BenchModel.materialize); says how long it took."""
    if model.random_weights:
        t = time.perf_counter()
        model.materialize(tmp / "weights", dtype)
        log(f"random weights written in {time.perf_counter() - t:.1f} s")


def run_in_own_session(command: list[str], **popen) -> int:
    """Run `command` in a session of its own (so Ctrl-C reaches this process alone) and wait:
    its exit status. Ctrl-C or SIGTERM here kills it before this process cleans up, even one
    that arrives while it starts (the signals wait until the child is known), so it never reads
    its files after they are gone."""
    stops = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    proc = None
    try:
        proc = subprocess.Popen(command, start_new_session=True, **popen)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return proc.wait()
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.wait()
        raise
    finally:  # the mask is still blocked here only when Popen itself raised
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def run_fresh(script: Path, tmp: Path, k: int, total: int, env: dict, spec: dict, what: str):
    """Run one measurement in a fresh process (`script --child-spec FILE`, which writes its
    JSON to spec["output"]) and return that JSON with process_s, the time the whole process
    took. A failed run stops the benchmark: quietly when the child printed its own one-line
    error (exit status EXIT_REPORTED), else naming the run (`what`)."""
    spec_path, out_path = tmp / f"run-{k}.json", tmp / f"result-{k}.json"
    spec_path.write_text(json.dumps({**spec, "sequence": k, "output": str(out_path)}))
    t = time.perf_counter()
    status = run_in_own_session(
        [sys.executable, str(script), "--child-spec", str(spec_path)],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - t
    if status == EXIT_REPORTED:
        raise SystemExit(1)  # the run said what went wrong, on one line
    if status != 0:
        raise SystemExit(
            f"run {k + 1}/{total} ({what}) failed with exit status {status}; its error is above"
        )
    run = json.loads(out_path.read_text())
    run["process_s"] = elapsed
    return run


def parse_args_or_run(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, child_main: Callable[[str], int]
) -> argparse.Namespace:
    """The command line, parsed; but in a run's own process (--child-spec FILE, from
    run_fresh) the run itself: child_main(FILE), then exit with its status."""
    args = p.parse_args(argv)
    if args.child_spec:
        raise SystemExit(child_main(args.child_spec))
    return args


@contextlib.contextmanager
def child_errors(solution: str, own_errors: tuple[type[Exception], ...] = (), what: str = ""):
    """In a run's fresh process: a solution that is not finished yet (NotImplementedError), one
    of the bench's `own_errors` (said as "error: {what}{the error}") or a checkpoint that cannot
    be read ends the process with one line on stderr and exit status EXIT_REPORTED, which
    tells run_fresh in the parent that the error has been said."""
    try:
        yield
    except NotImplementedError as e:
        print(unfinished_message(solution, e), file=sys.stderr)
        raise SystemExit(EXIT_REPORTED) from None
    except own_errors as e:
        print(f"error: {what}{e}", file=sys.stderr)
        raise SystemExit(EXIT_REPORTED) from None
    except CheckpointError as e:  # weights the parent could not check without loading them
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_REPORTED) from None


def load_weights(model: dict[str, Any], dtype: str) -> tuple[BenchModel, Checkpoint]:
    """In a run's fresh process: the BenchModel of a spec (BenchModel.to_dict) and its
    checkpoint in `dtype`, every weight read now (mx.load is lazy: not inside a timed run)."""
    bench_model = BenchModel.from_dict(model)
    ckpt = bench_model.load(dtype)
    mx.eval(list(ckpt.weights.values()))
    return bench_model, ckpt


def planned_run(spec: dict[str, Any]) -> dict[str, Any]:
    """Where a run stands in the plan (its repeat, order and place), and its process."""
    return {
        "repeat": spec["repeat"],
        "order": spec["order"],
        "sequence": spec["sequence"],
        "pid": os.getpid(),
    }


# --- output ------------------------------------------------------------------------------


def log(message: str) -> None:
    """Progress goes to stderr, so that stdout holds only the result table."""
    print(message, file=sys.stderr, flush=True)


def canonical_json(data: Any) -> str:
    """Sorted keys, no spaces: the same data always gives the same bytes (for checksums)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_sha256(data: Any) -> str:
    """The SHA-256 of canonical_json(data): one name for the same data everywhere."""
    return hashlib.sha256(canonical_json(data).encode("ascii")).hexdigest()


def check_outputs(p: argparse.ArgumentParser, *paths: str | Path | None) -> None:
    """Before the run: argparse's error, naming the path, for an output that could not be
    written at the end (a directory, a file where a folder should be, a folder this process
    may not write in). Creates nothing; None stands for an output not asked for."""
    for path in paths:
        problem = None if path is None else output_problem(Path(path))
        if problem:
            p.error(problem)


def output_problem(path: Path) -> str | None:
    """Why `path` cannot be written, or None: tried with a temporary file in the nearest
    folder that exists (the folders in between are made at the end)."""
    if path.is_dir():
        return f"{path} is a directory; give a file name"
    folder = path.parent
    while not folder.is_dir():
        if folder.exists():
            return f"cannot write {path}: {folder} is not a folder"
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"cannot write {path}: no file can be made in {folder} ({e.strerror})"
    return None


def replace_file(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` whole: into a file beside it, renamed over it once complete, so
    that an interrupted run leaves the old file (or none), never part of one. Says so on
    stderr when a file is replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text, encoding=encoding)
        if path.exists():
            log(f"replacing {path}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, data: Any) -> Path:
    """`data` as indented JSON in `path` (replace_file)."""
    return replace_file(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def relative_path(path: Path) -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


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


def log_model(model: BenchModel, args: argparse.Namespace, more: str = "") -> None:
    """Say which model runs (log_line), in which dtype, on which device, with which solution
    (args.dtype, args.device, args.solution), then `more`."""
    log(
        f"model {model.log_line()}, {args.dtype} on {device_name(args.device)}, solution "
        f"{SOLUTIONS[args.solution]}{more}"
    )


def report_start(
    schema: str, started: float, arguments: dict[str, Any], argv: Sequence[str] | None = None
) -> dict[str, Any]:
    """The fields every report starts with: its schema, when it started and how long it took,
    the command (argv: its arguments, when not sys.argv's) and its parsed arguments, the host
    and MLX."""
    return {
        "schema": schema,
        "created_unix": started,
        "duration_s": time.time() - started,
        "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)],
        "arguments": arguments,
        "host": host_info(),
        "mlx": mlx_info(),
    }


def runs_settings(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A report's device (as the first run said, or as asked where nothing ran), dtype and
    solution."""
    return {
        "device": runs[0]["device"] if runs else args.device,
        "dtype": args.dtype,
        "solution": SOLUTIONS[args.solution],
    }


def write_report(
    args: argparse.Namespace,
    report: dict[str, Any],
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], Path | None] | None = None,
    seconds: float | None = None,
) -> None:
    """The end of a benchmark: the report as JSON in --json-output and, given a `plot` function
    and no --no-plot, its plot in --plot-output, with a line on stderr for each file written
    (and the run's `seconds`, if given); then table(report) on stdout."""
    write_json(args.json_output, report)
    log(f"wrote {args.json_output}" + ("" if seconds is None else f" ({seconds:.0f} s)"))
    if plot is not None and not args.no_plot and plot(report, args.plot_output):
        log(f"wrote {args.plot_output}")
    print(table(report))


def pyplot():
    """matplotlib.pyplot drawing into files (the Agg backend), or None with a line saying that
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot (pdm sync -G dev installs it)")
        return None
    return plt


def save_figure(fig, path: Path, title: str | None = None, rect=(0, 0, 1, 1)) -> Path:
    """Finish a figure: its `title` (if any) above the panels, laid out within `rect` (of the
    figure: left, bottom, right, top), written to `path` (its folders made), closed."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def columns(head: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    """A text table: the head and every row, each cell right-aligned in its column's width."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [head, *rows]]


if __name__ == "__main__":  # quick look at the machine: python benches/common.py
    json.dump({"host": host_info(), "mlx": mlx_info(), "blas": blas_info()}, sys.stdout, indent=2)
    print()

"""The command line every benchmark shares: the "model" group, the output paths (checked before
the first run, not after the last), --repeats, and the model line of the log."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benches.harness.machine import device_name
from benches.harness.models import EMBEDDED_CONFIGS, BenchModel, resolve_bench_model
from benches.harness.progress import log
from tiny_llm_support import SHORTCUTS, gpu_available, load_checkpoint
from tiny_llm_support.checkpoint_files import CheckpointError
from tiny_llm_support.cli import (
    DEVICES,
    DTYPES,
    SOLUTIONS,
    add_solution_argument,
    default_dtype,
    int_at_least,
)

__all__ = [
    "bench_parser", "add_model_arguments", "bench_model_from_args", "bench_model_or_exit",
    "check_checkpoint_arg", "add_output_arguments", "set_output_paths", "arguments_json",
    "add_repeats_argument", "check_outputs",
    "output_problem", "log_model",
]  # fmt: skip


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


def add_repeats_argument(group: argparse._ActionsContainer, what: str, default: int) -> None:
    """--repeats: fresh processes per `what` (a mode, a budget...), in plan_runs' order."""
    group.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=default,
        help=f"processes per {what}; every other repeat runs the {what}s in reverse order",
    )


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


def log_model(model: BenchModel, args: argparse.Namespace, more: str = "") -> None:
    """Say which model runs (log_line), in which dtype, on which device, with which solution
    (args.dtype, args.device, args.solution), then `more`."""
    log(
        f"model {model.log_line()}, {args.dtype} on {device_name(args.device)}, solution "
        f"{SOLUTIONS[args.solution]}{more}"
    )

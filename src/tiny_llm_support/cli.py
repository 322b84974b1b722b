"""Command-line pieces shared by main.py, batch-main.py and the benchmarks: which solution to
run, devices and dtypes, argument types, printable model text, the OpenBLAS restart."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from .checkpoint import DTYPES
from .device import NO_OPENBLAS_ENV, OPENBLAS_HINT, blas_info, openblas_path, reexec_with_openblas
from .models import SHORTCUTS, resolve_model
from .quant_format import LINEAR_KERNELS, QUANTIZED_LINEAR_PATHS
from .startup import run as run_guarded

__all__ = [
    "DEVICES",
    "DTYPES",
    "DefaultsHelpFormatter",
    "SOLUTIONS",
    "add_engine_arguments",
    "add_solution_argument",
    "cpu_hints",
    "default_dtype",
    "float_at_least",
    "int_at_least",
    "int_between",
    "load_solution",
    "MODEL_HELP",
    "model_note",
    "model_options",
    "model_path",
    "printable",
    "ranks_problem",
    "reexec_with_openblas",
    "run_script",
    "script_parser",
    "text",
    "unfinished_message",
]

SOLUTIONS = {"ref": "tiny_llm_ref", "tiny_llm": "tiny_llm"}
DEVICES = ("auto", "cpu", "gpu")
MAX_RANKS = 64  # --tp: far more ranks than the course's models have heads to split
MODEL_HELP = (
    "'tiny' (a small chat model trained in the project, shipped), 'tiny-random' (random "
    "weights), a shortcut such as qwen3-0.6b, a Hugging Face repo id (org/name) or a local "
    "checkpoint directory"
)

# A random model writes any byte, escape sequences included: control characters print as
# U+FFFD. On one line, newlines show as a return arrow and tabs as a space.
_CONTROLS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}
_ONE_LINE = {**_CONTROLS, ord("\n"): "\u21b5", ord("\t"): " "}


def printable(text: str, one_line: bool = False) -> str:
    """Model text made safe to print on a terminal."""
    return text.translate(_ONE_LINE if one_line else _CONTROLS)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default, except where "(default: None)" or "(default: False)"
    would say nothing: a default of None (its help says what happens) and on/off flags."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def script_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with what the demo scripts take: --model, --solution, --device,
    --quantized-linear, --linear-kernel, and --tp with --hostfile (tensor-parallel ranks, Week 4
    Day 2; check them with ranks_problem)."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    add_solution_argument(p)
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: the GPU if any")
    p.add_argument(
        "--quantized-linear",
        choices=QUANTIZED_LINEAR_PATHS,
        default=None,
        help="how a quantized checkpoint's layers multiply (Week 4 Day 1; own-kernel: your C++ "
        "kernel of Week 5 Day 1, codes kept packed; default: the faster on the device)",
    )
    p.add_argument(
        "--linear-kernel",
        choices=LINEAR_KERNELS,
        default="mlx",
        help="what multiplies the passes of up to 16 rows of every linear layer (Week 5 Day 4): "
        "few-row is your C++ kernel; auto uses it on the CPU when it runs, else MLX's matmul "
        "(serve's default)",
    )
    add_tp_arguments(p)
    return p


def model_options(package: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Qwen3Model's keywords from --quantized-linear and --linear-kernel, each passed only when it
    can matter: --quantized-linear when given (else the solution's own default), --linear-kernel
    when the solution's Qwen3Model takes it (a stand-in, or a solution from before Week 5 Day 4,
    does not)."""
    options: dict[str, Any] = {}
    if getattr(args, "quantized_linear", None) is not None:
        options["quantized_linear"] = args.quantized_linear
    if "linear_kernel" in inspect.signature(package.Qwen3Model).parameters:
        options["linear_kernel"] = getattr(args, "linear_kernel", "mlx")
    return options


def add_engine_arguments(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """The engine's sizes and number type: batch-main's teaching sizes (5 slots, 512 tokens),
    or with `serving` serve's (8 slots; the context left open, for kv_memory.plan to fill in
    from the model and the memory)."""
    positive = int_at_least(1)
    p.add_argument("--batch-size", type=positive, default=8 if serving else 5, help="decode slots")
    p.add_argument("--prefill-step", type=positive, default=128, help="tokens per prefill chunk")
    context = "prompt + answer tokens"
    if serving:  # a default of None has no "(default: ...)" of its own in --help
        context += " (default: the model's positions, as far as the KV memory holds them)"
    p.add_argument("--max-seq-len", type=positive, default=None if serving else 512, help=context)
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weights and activations (default: float32 on cpu, bfloat16 on gpu)",
    )


def add_tp_arguments(p: argparse.ArgumentParser) -> None:
    """--tp and --hostfile (tensor-parallel ranks, Week 4 Day 2; check with ranks_problem)."""
    p.add_argument(
        "--tp",
        type=int_between(1, MAX_RANKS),
        default=1,
        help="tensor-parallel ranks (mlx.launch); without --hostfile at most this machine's "
        "CPU cores",
    )
    p.add_argument("--hostfile", help="with --tp: an mlx.launch hostfile (several machines)")


def ranks_problem(tp: int, hostfile: str | None) -> str | None:
    """Why --tp cannot run, or None: without a hostfile every rank is a process on this
    machine, so at most one per CPU core (two always: the course's two-rank runs work on any
    machine, if slowly on one core)."""
    cores = os.cpu_count() or 1
    if hostfile is None and tp > max(2, cores):
        return (
            f"--tp {tp} starts {tp} processes on this machine, which has {cores} CPU cores: "
            f"give at most --tp {max(2, cores)}, or a --hostfile of several machines"
        )
    return None


def add_solution_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--solution",
        choices=sorted(SOLUTIONS),
        default="ref",
        help="ref runs tiny_llm_ref, tiny_llm runs your own code",
    )


def load_solution(name: str) -> ModuleType:
    """The package a --solution name stands for, imported."""
    return importlib.import_module(SOLUTIONS[name])


def unfinished_message(solution: str, error: NotImplementedError) -> str:
    """One line for a solution that reached an exercise not written yet (the error names it)."""
    return (
        f"error: {SOLUTIONS.get(solution, solution)} is not finished yet: {error} (its chapter "
        "in the book explains it; --solution ref runs the reference solution)"
    )


def model_path(model: str, cache_dir: str | None = None) -> Path:
    """The checkpoint directory of a --model argument (downloaded if need be). An unknown name
    or a missing directory raises ValueError with the list of model names."""
    try:
        return resolve_model(model, cache_dir=cache_dir)
    except (ValueError, FileNotFoundError) as e:
        first = str(e) if isinstance(e, FileNotFoundError) else f"unknown model {model!r}"
        names = "\n".join(f"  {name:<12} {repo}" for name, repo in SHORTCUTS.items())
        raise ValueError(
            f"{first}\n\nModel names:\n  {'tiny':<12} a small chat model trained in the project, "
            f"shipped, offline\n  {'tiny-random':<12} random weights, made locally, offline (its "
            f"text is meaningless)\n{names}\nor a Hugging Face repo id (org/name), or a directory "
            "with config.json, *.safetensors and tokenizer.json."
        ) from e


def model_note(model: str) -> str | None:
    """A line about what to expect from the text of an offline model."""
    if model == "tiny-random":
        return (
            "note: 'tiny-random' has random weights: the engine's work is real, its text is "
            "meaningless"
        )
    if model == "tiny":
        return (
            "note: 'tiny' is a small model trained in the project on the book and the demo's "
            "questions; it knows little else. Try --model qwen3-0.6b for real answers."
        )
    return None


def default_dtype(device: str) -> str:
    """float32 on the CPU, where bf16 matmul is slow; bfloat16 on a GPU."""
    return "bfloat16" if device == "gpu" else "float32"


def cpu_hints(device: str, dtype: str) -> list[str]:
    """Lines for a slow CPU set-up: the wheel's reference BLAS on Linux, a 16-bit dtype."""
    hints = []
    if device == "cpu" and sys.platform.startswith("linux"):
        if blas_info()["blas"].startswith("reference"):
            if openblas_path() is None:
                hints.append(f"hint: {OPENBLAS_HINT}")
            elif os.environ.get(NO_OPENBLAS_ENV):
                hints.append(
                    f"hint: {NO_OPENBLAS_ENV} is set, so float32 matmul runs on the slow "
                    f"bundled BLAS; without it OpenBLAS ({openblas_path()}) is loaded by itself"
                )
    if device == "cpu" and dtype != "float32":
        hints.append(f"hint: {dtype} matmul is slow on the CPU; --dtype float32 is faster")
    return hints


def text(value: str) -> str:
    """An argparse type: text that is valid UTF-8. (Python hands bytes that are not UTF-8 to a
    program as lone surrogates, which no tokenizer accepts.)"""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(value[e.start]) - 0xDC00  # surrogateescape keeps the byte in U+DC80..U+DCFF
        where = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else repr(value[e.start])
        raise argparse.ArgumentTypeError(
            f"not valid UTF-8 text ({where} at character {e.start + 1})"
        ) from None
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `low`."""
    return _at_least(int, low, "an integer")


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high`."""
    at_least = int_at_least(low)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"expected an integer <= {high}, got {value}")
        return value

    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a number no smaller than `low`."""
    return _at_least(float, low, "a number")


def _at_least(kind: type, low: float, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= low:  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {value}")
        return value

    return parse


class UsageError(Exception):
    """Bad input from the user: printed without a traceback, exit status 2."""


def run_main(parse_args: Callable, run: Callable, argv: list[str] | None) -> int:
    """A script's main(): parse the arguments and run; a UsageError is one line, status 2."""
    args = parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_script(main: Callable[[], int]) -> None:
    """A script run from the command line: with OpenBLAS where it helps, Ctrl-C and SIGTERM
    as one line, and main()'s return value as the exit status."""
    reexec_with_openblas()  # returns only where no restart is needed
    sys.exit(run_guarded(main))

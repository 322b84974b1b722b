"""Choosing the MLX device, and which BLAS the CPU backend is using."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import mlx.core as mx

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)

OPENBLAS_HINT = (
    "On Linux the mlx[cpu] wheel runs float32 matmul on its bundled reference BLAS, about "
    "5 GFLOP/s. Install OpenBLAS with `sudo apt-get install libopenblas0-pthread`: the demo and "
    "the benchmarks then load it by themselves (about 194 GFLOP/s on 2 cores). bf16 matmul "
    "stays slow on the CPU either way: use float32."
)


def gpu_available() -> bool:
    """True when MLX has a Metal or CUDA backend with a device."""
    for backend in ("metal", "cuda"):
        module = getattr(mx, backend, None)
        is_available = getattr(module, "is_available", None)
        try:
            if is_available is not None and is_available():
                return True
        except RuntimeError:
            continue
    return False


def choose_device(name: str | None = None) -> str:
    """Pick "gpu" or "cpu" ("auto"/None: the GPU when there is one) and make it the default."""
    requested = (name or "auto").lower()
    if requested not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu or gpu")
    if requested == "gpu" and not gpu_available():
        raise ValueError("device 'gpu' requested, but MLX has no Metal or CUDA device here")
    device = requested if requested != "auto" else ("gpu" if gpu_available() else "cpu")
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    return device


def openblas_path() -> str | None:
    """Debian's OpenBLAS library, if this is Linux and it is installed."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in OPENBLAS_PATHS if Path(p).exists()), None)


def blas_info() -> dict[str, str | None]:
    """Which BLAS MLX's CPU backend runs on in this process."""
    if sys.platform == "darwin":
        blas = "accelerate"
    elif _openblas_loaded():
        blas = "openblas (LD_PRELOAD)"
    else:
        blas = "reference (bundled netlib)"
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "blas": blas,
        "openblas_path": openblas_path(),
    }


def _openblas_loaded() -> bool:
    """A system OpenBLAS is mapped (numpy's private scipy_openblas copy does not count)."""
    try:
        maps = Path("/proc/self/maps").read_text().lower().splitlines()
    except OSError:
        return False
    libs = {line.split()[-1] for line in maps if "openblas" in line}
    return any("scipy_openblas" not in lib and "numpy" not in lib for lib in libs)


NO_OPENBLAS_ENV = "TINY_LLM_NO_OPENBLAS"  # set to 1 to keep the bundled BLAS
_REEXEC_MARK = "TINY_LLM_OPENBLAS_PRELOADED"


def openblas_preload_env(env: dict[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """A copy of the environment with Debian's OpenBLAS preloaded on Linux.

    Returns (env, the OpenBLAS path preloaded, or None where nothing was added: not Linux,
    not installed, or this process already runs on it). LD_PRELOAD entries already there
    are kept.
    """
    env = dict(os.environ if env is None else env)
    lib = openblas_path()
    current = env.get("LD_PRELOAD", "")
    if lib is None or blas_info()["blas"].startswith("openblas"):
        return env, None  # children inherit whatever this process runs on
    if lib in current.replace(" ", ":").split(":"):
        return env, lib
    env["LD_PRELOAD"] = f"{lib}:{current}" if current else lib
    return env, lib


def reexec_with_openblas() -> None:
    """Restart this script once with Debian's OpenBLAS preloaded, where that helps.

    On Linux the mlx[cpu] wheel runs float32 matmul on a bundled reference BLAS, many times
    slower than OpenBLAS (the book's setup chapter has the measured figure). Nothing happens off Linux, without OpenBLAS installed, when it is
    already loaded, with TINY_LLM_NO_OPENBLAS=1, or in the restarted process itself.
    """
    if os.environ.get(NO_OPENBLAS_ENV) or os.environ.get(_REEXEC_MARK):
        return
    env, lib = openblas_preload_env()
    if lib is None:
        return
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # as started: -m too

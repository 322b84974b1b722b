"""The machine a benchmark ran on: host, MLX, and the BLAS (which library, which OpenBLAS
kernels) of this process and of the runs it starts, recorded in every report."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from benches.harness.progress import log
from tiny_llm_support import blas_info, gpu_available, openblas_preload_env

__all__ = [
    "OLD_OPENBLAS_CORES", "BLAS_VARIABLES", "host_info", "host_slug", "mlx_info", "blas_info",
    "device_name", "package_version", "environment", "openblas_core", "process_blas",
    "openblas_hint", "log_blas", "runs_environment",
    "runs_openblas_core", "probe_openblas_core", "log_runs_blas", "runs_blas", "memory_bytes",
]  # fmt: skip

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

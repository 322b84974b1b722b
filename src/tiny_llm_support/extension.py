"""Week 5's C++ extension: built from a solution's `csrc/` folder on first use, and again only
when a source file changed, then imported.

`load(package_dir)` builds `<package_dir>/csrc` with CMake (PyPI's cmake and ninja, in the
project's environment) into `build/ext/<module>` beside the project's pyproject.toml (or beside
the package, for a copy of it elsewhere), and imports the module it makes: for
`src/tiny_llm_ref` the module `tiny_llm_ref_ext`, for `src/tiny_llm` the module `tiny_llm_ext`.
The build folder keeps a stamp, a hash of the sources and of the tools, so an unchanged
extension is imported at once. Two processes building the same folder take turns (a file lock).

Missing tools are one line that names them (ExtensionBuildError); a compile error shows the
compiler's own messages.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

_loaded: dict[Path, ModuleType] = {}


class ExtensionBuildError(RuntimeError):
    """The C++ extension could not be built: a tool is missing or the code does not compile."""


def module_name(package_dir: Path) -> str:
    return f"{package_dir.name}_ext"


def load(package_dir: Path) -> ModuleType:
    """The extension module of one solution package, built first when needed."""
    package_dir = package_dir.resolve()
    if package_dir not in _loaded:
        name = module_name(package_dir)
        build_dir = _build_dir(package_dir, name)
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it now
            library = _built(package_dir / "csrc", build_dir, name)
        _loaded[package_dir] = _import(name, library)
    return _loaded[package_dir]


def _build_dir(package_dir: Path, name: str) -> Path:
    """build/ext/<module> beside pyproject.toml, or beside the package in a copy without one."""
    root = package_dir.parent.parent
    if not (root / "pyproject.toml").exists():
        root = package_dir.parent
    return root / "build" / "ext" / name


def _built(sources: Path, build_dir: Path, name: str) -> Path:
    """The path of the built module, building it when its stamp is out of date."""
    stamp = build_dir / "stamp"
    digest = _digest(sources)
    library = _module_file(build_dir, name)
    if library is not None and stamp.exists() and stamp.read_text() == digest:
        return library
    cmake, ninja = _tool("cmake"), _tool("ninja")
    _check_compiler()
    print(f"building the C++ extension {name} from {sources} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    configure = [cmake, "-S", str(sources), "-B", str(build_dir), "-G", "Ninja"]
    configure += [f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DPython_EXECUTABLE={sys.executable}"]
    _run(configure, "configure")
    _run([cmake, "--build", str(build_dir)], "compile")
    library = _module_file(build_dir, name)
    if library is None:
        raise ExtensionBuildError(
            f"the C++ extension built, but no module {name} came out of it: "
            f"{sources / 'CMakeLists.txt'} must name its module {name}"
        )
    stamp.write_text(digest)
    print(f"built {name} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return library


def _module_file(build_dir: Path, name: str) -> Path | None:
    return next(build_dir.glob(f"{name}.*.so"), None) or next(build_dir.glob(f"{name}.so"), None)


def _digest(sources: Path) -> str:
    """A hash of every source file and of what the build depends on outside them."""
    h = hashlib.sha256()
    for path in sorted(p for p in sources.rglob("*") if p.is_file()):
        h.update(path.relative_to(sources).as_posix().encode() + b"\0" + path.read_bytes())
    import mlx.core as mx

    h.update(f"{mx.__version__} {sys.version} {platform.machine()}".encode())
    return h.hexdigest()


def _tool(name: str) -> str:
    """cmake or ninja: the project's environment has both (PyPI's wheels)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise ExtensionBuildError(
            f"cannot build the C++ extension: {name} not found (it comes with the project: "
            f"`pdm sync -G dev -G book`, or `pip install {name}`)"
        )
    return found


def _check_compiler() -> None:
    compilers = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        fix = "xcode-select --install" if sys.platform == "darwin" else "sudo apt install g++"
        raise ExtensionBuildError(
            f"cannot build the C++ extension: no C++ compiler found (c++, g++ or clang++; `{fix}`)"
        )
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        raise ExtensionBuildError(
            f"cannot build the C++ extension: Python's headers are missing ({headers}; "
            f"`sudo apt install python3-dev`)"
        )


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        errors = [line for line in output.splitlines() if "error" in line.lower()]
        shown = "\n".join(errors[:20] or output.splitlines()[-20:])
        raise ExtensionBuildError(f"the C++ extension failed to {what}:\n{shown}")


def _import(name: str, library: Path) -> ModuleType:
    import mlx.core  # noqa: F401  (the extension uses MLX's Python types: load them first)

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module

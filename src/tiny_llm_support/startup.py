"""How an entry point (main.py, batch-main.py, a benchmark) starts and ends: Ctrl-C at any
moment prints `interrupted` and exits with status 130, and an MLX that cannot be imported gets
one line saying why and what repairs it. Standard library only: an entry point calls start()
before it imports MLX (this package's __init__ imports nothing until a name is used), and only
when it runs as a script, so that a test importing it keeps its own Ctrl-C.

    from tiny_llm_support import startup

    if __name__ == "__main__":
        startup.start()  # before the imports that load MLX
    import mlx.core as mx  # noqa: E402
    ...
    if __name__ == "__main__":
        sys.exit(startup.run(main))
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT)
CPU_BUILD_COMMAND = "pdm sync --clean-unselected --reinstall -G dev -G book"


def start() -> None:
    """Until run() takes over, Ctrl-C ends the process at once (there is nothing to clean up
    while modules load); then import MLX, or exit with one line if it cannot be imported."""
    signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        import mlx.core  # noqa: F401
    except (ImportError, OSError) as e:
        print(f"error: {mlx_import_message(e)}", file=sys.stderr)
        raise SystemExit(1) from None


def run(main: Callable[[], int]) -> int:
    """Call main() with Ctrl-C raising KeyboardInterrupt again, so that `finally` blocks and
    context managers (temporary directories, child processes) clean up; then `interrupted`."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED


def mlx_import_message(error: BaseException) -> str:
    """What a failed `import mlx.core` means, on one line."""
    detail = " ".join(str(error).split())
    if "cuda" in detail.lower():
        return (
            f"MLX cannot start: {detail}. This environment has MLX's CUDA build (the `cuda` "
            "extra, which `pdm install -G :all` adds), and this machine has no NVIDIA driver. "
            f"Put the CPU build back with: {CPU_BUILD_COMMAND}"
        )
    return f"MLX cannot start: {detail}. Reinstall the environment with: {CPU_BUILD_COMMAND}"


def _exit_interrupted(signum: int, frame: FrameType | None) -> None:
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)

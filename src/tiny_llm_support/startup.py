"""How an entry point (main.py, batch-main.py, a benchmark, a dev tool) starts and ends: Ctrl-C
at any moment prints `interrupted` and exits with status 130, SIGTERM prints `terminated` and
exits with 143, a reader of its output that goes away (`| head -1`) ends it quietly with status
141, and an MLX that cannot be imported gets one line saying why and what repairs it. In a
tensor-parallel rank (a process mlx.launch started) an error is one line naming it, and a
signal ends it without a word: the command that started the ranks speaks for them.

Standard library only: an entry point calls start() before it imports MLX (this package's
__init__ imports nothing until a name is used), and only when it runs as a script, so that a
test importing it keeps its own Ctrl-C.

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
import traceback
from collections.abc import Callable
from types import FrameType

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT)
TERMINATED = 143  # the exit status of a command stopped by SIGTERM (128 + SIGTERM)
CLOSED_PIPE = 141  # the exit status of a command whose output pipe closed (128 + SIGPIPE)
CPU_BUILD_COMMAND = "pdm sync --clean-unselected --reinstall -G dev -G book"
RANK_ENV = "MLX_RANK"  # mlx.launch sets it in every process it starts


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same `finally` blocks and handlers clean up."""


def start() -> None:
    """Until run() takes over, Ctrl-C and SIGTERM end the process at once (there is nothing to
    clean up while modules load); then import MLX, or exit with one line if it cannot be
    imported."""
    signal.signal(signal.SIGINT, _exit_at_once)
    signal.signal(signal.SIGTERM, _exit_at_once)
    try:
        import mlx.core  # noqa: F401
    except (ImportError, OSError) as e:
        print(f"error: {mlx_import_message(e)}", file=sys.stderr)
        raise SystemExit(1) from None


def run(main: Callable[[], int]) -> int:
    """Call main() with Ctrl-C raising KeyboardInterrupt again and SIGTERM raising Terminated,
    so that `finally` blocks and context managers (temporary directories, child processes)
    clean up; then `interrupted` or `terminated`. A closed output pipe raises BrokenPipeError
    at the next write, which cleans up the same way and ends without a word."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_terminated)
    in_rank = RANK_ENV in os.environ
    try:
        status = main()
        sys.stdout.flush()  # the last lines: a closed pipe shows here, not at Python's exit
        return status
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        if not in_rank:
            print("terminated" if terminated else "interrupted", file=sys.stderr, flush=True)
        return TERMINATED if terminated else INTERRUPTED
    except BrokenPipeError:
        _drop_stdout()
        return CLOSED_PIPE
    except Exception as e:
        if not in_rank:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return 1


def one_line(error: BaseException) -> str:
    """An exception as one line: its type, its message and the line of code that raised it."""
    frames = traceback.extract_tb(error.__traceback__)
    place = ""
    if frames:
        where = frames[-1]
        place = f" ({os.path.basename(where.filename)}:{where.lineno}, in {where.name})"
    return f"{type(error).__name__}: {' '.join(str(error).split())}{place}"


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


def _drop_stdout() -> None:
    """Point stdout at /dev/null: Python flushes it once more at exit, and the text left in
    its buffer would raise the same error there, as a message of its own."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    interrupted = signum == signal.SIGINT
    print("interrupted" if interrupted else "terminated", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED if interrupted else TERMINATED)

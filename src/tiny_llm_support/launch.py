"""Starting tensor-parallel ranks with `mlx.launch` (Week 4 Day 2).

A script that takes `--tp N` runs its own command line again as N processes:

    if args.tp > 1 and not in_ranks():
        return relaunch_as_ranks(args.tp, args.hostfile)
    group = join_ranks(args.tp) if args.tp > 1 else None   # in each rank

Without a hostfile the N ranks run on this machine and talk over the ring backend on
127.0.0.1. With a hostfile (the JSON file `mlx.launch --hostfile` reads: for every rank the
host to ssh into and the IP address the ring connects to) they run on those machines; each
needs the project and its environment at the same path as here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import mlx.core as mx

RANK_ENV = "MLX_RANK"  # mlx.launch sets it in every process it starts
# OpenBLAS starts one thread per core in every process: N ranks on one machine would run N
# times as many threads as cores, which OpenBLAS's spinning threads make very slow.
BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


def in_ranks() -> bool:
    """True in a process that mlx.launch started."""
    return RANK_ENV in os.environ


def mlx_launch_path() -> str:
    """The mlx.launch script of the environment this Python runs in."""
    beside = Path(sys.executable).parent / "mlx.launch"
    found = str(beside) if beside.is_file() else shutil.which("mlx.launch")
    if found is None:
        raise FileNotFoundError("mlx.launch not found: is MLX installed in this environment?")
    return found


def free_ports(count: int) -> int:
    """A port p such that p .. p + count - 1 are free on 127.0.0.1 right now (the ring backend
    listens on one port per rank, counting up from the starting port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            start = s.getsockname()[1]
        if start + count <= 65535 and all(_is_free(p) for p in range(start, start + count)):
            return start
    raise RuntimeError(f"found no {count} consecutive free ports on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_command(command: list[str], ranks: int, hostfile: str | Path | None = None) -> list[str]:
    """The mlx.launch command line that runs `python command...` as `ranks` processes over the
    ring backend: on this machine, or on the hosts of an mlx.launch hostfile."""
    if ranks < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {ranks}")
    cmd = [mlx_launch_path(), "--backend", "ring", "--python", sys.executable]
    if hostfile is None:
        cmd += ["-n", str(ranks), "--hosts", "127.0.0.1", "--starting-port", str(free_ports(ranks))]
    else:
        cmd += ["--hostfile", str(hostfile)]
    return [*cmd, *command]


def launch(
    command: list[str],
    ranks: int,
    hostfile: str | Path | None = None,
    timeout: float | None = None,
    output: IO | int | None = None,
) -> int:
    """Run `python command...` as `ranks` processes and return mlx.launch's exit status.

    Ranks on this machine get OPENBLAS_NUM_THREADS = cores / ranks unless it is set already.
    output: where the ranks' stdout and stderr go (None: this process's own). On a timeout or
    Ctrl-C every process of the launch is stopped before the exception goes on.
    mlx.launch writes a pid file and a host file per rank with mktemp and leaves them: here
    they go to a temporary directory of the launch's own, removed at the end.
    """
    cmd = launch_command(command, ranks, hostfile)
    env = dict(os.environ)
    if hostfile is None:  # every rank on this machine: share its cores instead of each taking all
        env.setdefault(BLAS_THREADS_ENV, str(max(1, (os.cpu_count() or 1) // ranks)))
    with tempfile.TemporaryDirectory(prefix="tiny-llm-ranks-") as tmp:
        env["TMPDIR"] = tmp
        # mlx.launch forwards its stdin to the ranks and polls it; a pipe that stays open until
        # the end keeps that poll waiting (at end of file it would spin on a core).
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            start_new_session=True,  # its own process group: the ranks can be stopped with it
        )
        try:
            return proc.wait(timeout)
        except BaseException:  # a timeout, or Ctrl-C here: stop the launcher and every rank
            stop_group(proc)
            raise
        finally:
            proc.stdin.close()


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop every process of proc's process group (the launcher and its ranks): SIGTERM,
    then SIGKILL for any still there after grace_s seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(proc.pid, 0)  # raises once no process of the group is left
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        time.sleep(0.02)


def relaunch_as_ranks(ranks: int, hostfile: str | Path | None = None) -> int:
    """Run this script's own command line again as `ranks` processes; their exit status."""
    script = str(Path(sys.argv[0]).resolve())
    return launch([script, *sys.argv[1:]], ranks, hostfile)


def join_ranks(ranks: int) -> mx.distributed.Group:
    """In a process mlx.launch started: the group of all ranks, which must have `ranks`
    members. Only rank 0 prints: the others' stdout goes to /dev/null (stderr stays, so an
    error on any rank is seen)."""
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != ranks:
        raise ValueError(f"--tp {ranks}, but mlx.launch started {group.size()} ranks")
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (kept open for the whole run)
    return group

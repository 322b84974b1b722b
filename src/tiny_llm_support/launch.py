"""Starting tensor-parallel ranks with `mlx.launch` (Week 4 Day 2).

A script that takes `--tp N` runs its own command line again as N processes:

    if args.tp > 1 and not in_ranks():  # the command as typed: check, then start the ranks
        return relaunch_as_ranks(checkpoint_dir, args.tp, args.hostfile)
    group = join_ranks(args.tp) if args.tp > 1 else None   # in each rank

Without a hostfile the N ranks run on this machine and talk over the ring backend on
127.0.0.1. With a hostfile (the JSON file `mlx.launch --hostfile` reads: for every rank the
host to ssh into and the IP address the ring connects to) they run on those machines; each
needs the project and its environment at the same path as here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import mlx.core as mx

from .cli import UsageError
from .config import Qwen3Config
from .startup import RANK_ENV

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
    return [*cmd, "--", *command]  # after "--": `-m module` is the command's, not mlx.launch's


def launch(
    command: list[str],
    ranks: int,
    hostfile: str | Path | None = None,
    timeout: float | None = None,
    output: IO | None = None,
) -> int:
    """Run `python command...` as `ranks` processes: 0 when every rank exited with 0, else 1
    (mlx.launch itself exits with 0 whatever its ranks do). See run_ranks."""
    return 0 if run_ranks(command, ranks, hostfile, timeout, output) is None else 1


def run_ranks(
    command: list[str],
    ranks: int,
    hostfile: str | Path | None = None,
    timeout: float | None = None,
    output: IO | None = None,
) -> str | None:
    """Run `python command...` as `ranks` processes; None when every rank exited with 0, else
    a line naming the rank that failed first and why (RankEnds).

    Ranks on this machine get OPENBLAS_NUM_THREADS = cores / ranks unless it is set already.
    output: a file that takes the ranks' stdout and stderr whole (None: this process's own,
    less the lines RankEnds holds back). On a timeout, Ctrl-C or SIGTERM every process of the
    launch is stopped before the exception goes on.
    mlx.launch writes a pid file and a host file per rank with mktemp and leaves them: here
    they go to a temporary directory of the launch's own, removed at the end.
    """
    cmd = launch_command(command, ranks, hostfile)
    env = dict(os.environ)
    if hostfile is None:  # every rank on this machine: share its cores instead of each taking all
        env.setdefault(BLAS_THREADS_ENV, str(max(1, (os.cpu_count() or 1) // ranks)))
    ends = RankEnds(ranks, output)
    with tempfile.TemporaryDirectory(prefix="tiny-llm-ranks-") as tmp:
        env["TMPDIR"] = tmp
        # mlx.launch forwards its stdin to the ranks and polls it; a pipe that stays open until
        # the end keeps that poll waiting (at end of file it would spin on a core).
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            env=env,
            stdout=output,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the ranks can be stopped with it
        )
        reader = threading.Thread(target=ends.read, args=(proc.stderr,), daemon=True)
        reader.start()
        try:
            proc.wait(timeout)
        except BaseException:  # a timeout, Ctrl-C or SIGTERM: stop the launcher and every rank
            stop_group(proc)
            raise
        finally:
            proc.stdin.close()
            reader.join(READ_GRACE_S)  # the rest of the output, before a word of this process
    return ends.failure()


# How mlx.launch says that a rank ended badly (its own exit status is 0 all the same).
RANK_END = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
# The status of a rank that mlx.launch stopped because another one failed.
STOPPED = (-signal.SIGTERM, 128 + signal.SIGTERM)
READ_GRACE_S = 5.0


class RankEnds:
    """Reads the stderr of mlx.launch, which carries the ranks' stderr and its own lines about
    how each rank ended. With an output file every line goes there as it comes. Otherwise the
    lines go to this process's stderr, less two kinds held back for failure(): mlx.launch's
    line about a rank that ended badly, and the ranks' `error: ...` lines (every rank of a run
    that fails tends to print the same one)."""

    def __init__(self, ranks: int, output: IO | None = None):
        self.ranks, self.output = ranks, output
        self.ends: list[tuple[int, int | None]] = []  # (rank, exit status; None: killed)
        self.errors: list[str] = []

    def read(self, stream: IO) -> None:
        out = self.output or sys.stderr
        for line in stream:
            end = RANK_END.search(line)
            if end:
                self.ends.append((int(end[1]), None if end[2] is None else int(end[2])))
            elif line.startswith("error: "):
                self.errors.append(line.removeprefix("error: ").strip())
            if self.output is not None or not (end or line.startswith("error: ")):
                out.write(line)
                out.flush()

    def failure(self) -> str | None:
        """None when no rank ended badly; else one line: the first rank that failed on its
        own (not one that mlx.launch stopped after it) and the first error a rank printed, or
        else how it ended."""
        if not self.ends:
            for error in self.errors:  # printed by a rank that exited with 0 all the same
                print(f"error: {error}", file=sys.stderr)
            return None
        rank, status = next(((r, s) for r, s in self.ends if s not in STOPPED), self.ends[0])
        if self.errors:
            why = self.errors[0]
        elif status is None:
            why = "mlx.launch killed it"
        elif status < 0:
            why = f"it was killed by {signal.Signals(-status).name}"
        else:
            why = f"it exited with status {status}"
        return f"rank {rank} of {self.ranks} failed: {why}"


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


def group_problem(config: Qwen3Config, ranks: int) -> str | None:
    """Why `ranks` ranks cannot split this model (every rank keeps an equal share of the
    query heads, the KV heads, the MLP's features and, in a mixture of experts, the experts),
    or None. Checked before any rank starts."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    if any(config.is_sparse(layer) for layer in range(config.num_hidden_layers)):
        sizes["num_experts"] = config.num_experts
    for name, size in sizes.items():
        if size % ranks:
            fits = [n for n in range(2, ranks) if all(s % n == 0 for s in sizes.values())]
            hint = f"; {fits[-1]} ranks would split every size" if fits else ""
            return (
                f"the model's {name} ({size}) does not divide into {ranks} equal shares, one "
                f"per rank{hint}"
            )
    return None


def relaunch_as_ranks(checkpoint: Path, ranks: int, hostfile: str | Path | None = None) -> int:
    """Run this script's own command line again as `ranks` processes: 0 when they all exit
    with 0, else 1 after one line naming the rank that failed and why. First, before any rank
    starts, a UsageError when `ranks` cannot split the model in `checkpoint` (group_problem);
    a config.json that cannot be read raises CheckpointError."""
    problem = group_problem(Qwen3Config.from_file(Path(checkpoint) / "config.json"), ranks)
    if problem:
        raise UsageError(f"--tp {ranks}: {problem}")
    script = str(Path(sys.argv[0]).resolve())
    failure = run_ranks([script, *sys.argv[1:]], ranks, hostfile)
    if failure is None:
        return 0
    print(f"error: {failure}", file=sys.stderr)
    return 1


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

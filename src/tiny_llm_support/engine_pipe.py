"""The HTTP process's handle on one engine process of serve.py: the process, started with spawn,
its pipe, and the writer thread that sends what the handlers put in its outbox. EngineClient
(server_engine.py) reads the pipe on the event loop, and starts a new process when one ends.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import signal
import threading
from pathlib import Path
from typing import Any

from . import engine_process

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class EngineStartError(Exception):
    """The engine process did not start. kind: "unfinished" (an exercise not written yet),
    "usage" (the flags), or "error"; the message is the line serve prints."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EngineProcess:
    """One engine process and its pipe, whose messages the event loop reads as they come
    (EngineClient.attach); a writer thread sends what is put in `outbox`."""

    def __init__(self, args: argparse.Namespace, path: Path, draft_path: Path | None) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no MLX state forked
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=engine_process.main, args=(child_conn, args, path, draft_path), daemon=True
        )
        # The engine ignores Ctrl-C and SIGTERM (this process closes it): blocked while it
        # starts, and held for this process meanwhile, so that neither is lost or reaches it.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        child_conn.close()
        self.outbox: queue.Queue = queue.Queue()

    def wait_ready(self) -> dict[str, Any]:
        """The engine's "ready" info, or EngineStartError. Polls, so Ctrl-C is heard."""
        while not self.conn.poll(0.1):
            if not self.process.is_alive() and not self.conn.poll(0):
                status = self.process.exitcode
                raise EngineStartError(
                    "error", f"the engine process ended at start (status {status})"
                )
        try:
            message = self.conn.recv()
        except EOFError:
            raise EngineStartError("error", "the engine process ended at start") from None
        if message[0] == "failed":
            raise EngineStartError(message[1], message[2])
        return message[1]

    def start_writer(self) -> None:
        """The thread that sends what is put in `outbox`, until None."""
        threading.Thread(target=self._write, name="engine-writer", daemon=True).start()

    def _write(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except OSError:  # the engine is gone: the event loop hears of it from the pipe
                return

    def stop(self, timeout: float) -> None:
        """Ask the engine to stop, then wait; killed if it does not."""
        self.outbox.put(("close",))
        self.outbox.put(None)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

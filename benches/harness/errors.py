"""An error of the student's solution, or of a benchmark's own checks, said in one line instead of
a traceback, for a benchmark that measures in its own process (`OneLineErrors`; a run in a fresh
process has runs.child_errors)."""

from __future__ import annotations

from benches.harness.progress import log
from tiny_llm_support.checkpoint_files import CheckpointError
from tiny_llm_support.cli import unfinished_message

__all__ = ["OneLineErrors"]


class OneLineErrors:
    """Around a benchmark's work: `with OneLineErrors(args.solution, Disagreement) as errors:`.
    A solution not finished yet (NotImplementedError), one of the bench's own errors (the types
    after `solution`) or a checkpoint that cannot be read is said in one line on stderr, the
    with block ends there and errors.status becomes 1, the benchmark's exit status. Any other
    error goes on up, with its traceback."""

    def __init__(self, solution: str, *own: type[Exception]):
        self.solution, self.own, self.status = solution, own, 0

    def __enter__(self) -> OneLineErrors:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, NotImplementedError):
            log(unfinished_message(self.solution, error))
        elif isinstance(error, (*self.own, CheckpointError)):
            log(f"error: {error}")
        else:
            return False  # no error, or one that is not ours to say
        self.status = 1
        return True

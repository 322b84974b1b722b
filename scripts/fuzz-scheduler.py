"""Property-based search of the scheduler's invariants: `pdm run fuzz-scheduler [--help]`.

Runs the checks of tests/scheduler_fuzz.py (the same ones tests/test_scheduler_properties.py
runs in CI) on as many random examples as asked. The search goes in rounds of ROUND examples,
each with its own seed; a failure ends its round, is shrunk to a minimal example and printed
as an Example(...) that pastes into a regression test, and the next round goes on. Exit
status 1 if anything failed, 130 on Ctrl-C.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C while the imports below load: `interrupted`, status 130

# ruff: noqa: E402 (the imports below load MLX)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # scheduler_fuzz and the helpers it uses

import hypothesis.strategies as st
import mlx.core as mx
from hypothesis import HealthCheck, Verbosity, given, seed, settings
from scheduler_fuzz import Fuzz, check_example, describe, examples

from tiny_llm_support.cli import add_solution_argument, load_solution, unfinished_message

ROUND = 100  # examples per hypothesis run
PROGRESS_EVERY_S = 30.0


class Unfinished(BaseException):
    """The solution reached an exercise not written yet (a BaseException: hypothesis lets it
    through at once instead of shrinking it)."""


class Search:
    """The counts of the whole search, and the failures found so far."""

    def __init__(self, fuzz: Fuzz, total: int):
        self.fuzz, self.total = fuzz, total
        self.tried = self.shrink_runs = 0
        self.failures: list[tuple[str, str]] = []  # (minimal example, error)
        self.started = self.last_progress = time.monotonic()
        self.failing = None  # the latest (example, error) that failed in this round

    def run_round(self, round_seed: int, size: int) -> None:
        """Up to `size` examples; a failure is shrunk and recorded, and ends the round."""
        self.failing = None
        strategy = st.one_of(examples(), examples(pools=("paged", "in-place"), pressure=True))

        @seed(round_seed)
        @settings(
            max_examples=size,
            database=None,
            deadline=None,
            verbosity=Verbosity.quiet,  # the failure is printed below, in full
            report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(ex=strategy)
        def one(ex):
            self.check(ex)

        try:
            one()
        except Exception:  # hypothesis re-raises the shrunk failure: self.failing holds it
            self.record_failure()

    def check(self, ex) -> None:
        if self.failing is None:
            self.tried += 1
        else:
            self.shrink_runs += 1  # after the first failure of a round, hypothesis shrinks
        try:
            check_example(self.fuzz, ex)
        except NotImplementedError as e:
            raise Unfinished(e) from e  # not a failure to shrink: an exercise not written yet
        except Exception as e:
            self.failing = (ex, f"{type(e).__name__}: {e}")
            raise
        finally:
            self.progress(ex)

    def record_failure(self) -> None:
        ex, error = self.failing
        self.failures.append((repr(ex), error))
        print(f"\nFAILURE {len(self.failures)}: {error}\nminimal example:\n{ex!r}\n", flush=True)

    def progress(self, ex) -> None:
        now = time.monotonic()
        if now - self.last_progress >= PROGRESS_EVERY_S:
            self.last_progress = now
            print(f"  {self.summary()}; last: {describe(ex)}", flush=True)

    def summary(self) -> str:
        elapsed = time.monotonic() - self.started
        rate = self.tried / elapsed if elapsed else 0.0
        shrink = f" (+{self.shrink_runs} shrink runs)" if self.shrink_runs else ""
        return (
            f"{self.tried}/{self.total} examples{shrink} in {elapsed:.0f} s ({rate:.1f}/s), "
            f"{len(self.failures)} failures"
        )


def main() -> int:
    p = argparse.ArgumentParser(
        prog="fuzz-scheduler",
        description="Random traces and settings through batch_generate, every property checked.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--examples", type=int, default=200, help="how many examples to try")
    p.add_argument("--seed", type=int, default=0, help="the first round's seed")
    add_solution_argument(p)
    args = p.parse_args()
    if args.examples < 1:
        p.error(f"--examples must be >= 1, got {args.examples}")
    mx.set_default_device(mx.cpu)  # float32 on the CPU, as the tests run
    impl = load_solution(args.solution)
    with tempfile.TemporaryDirectory(prefix="fuzz-scheduler-") as tmp:
        search = Search(Fuzz(impl, tmp), args.examples)
        print(f"fuzz-scheduler: {args.examples} examples of {impl.__name__}, seed {args.seed}")
        try:
            rounds = 0
            while search.tried < args.examples:
                size = min(ROUND, args.examples - search.tried)
                search.run_round(args.seed + rounds, size)
                rounds += 1
        except KeyboardInterrupt:  # startup.run prints `interrupted` and exits 130
            print(f"\n{search.summary()}", flush=True)
            raise
        except Unfinished as e:
            print(unfinished_message(args.solution, e.args[0]), file=sys.stderr)
            return 1
    print(f"done: {search.summary()}")
    for n, (ex, error) in enumerate(search.failures, start=1):
        print(f"\nfailure {n}: {error}\n{ex}")
    return 1 if search.failures else 0


if __name__ == "__main__":
    sys.exit(startup.run(main))

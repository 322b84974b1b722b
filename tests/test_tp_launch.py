"""Two ranks under mlx.launch, when one of them dies (not a course day: it checks the test
harness of Week 4 Day 2, tests/tp_ranks.py, and passes whatever the package under test holds).

Rank 1 raises while rank 0 waits for it in the first check's all_sum: the launch must end on
its own, well before its time limit, and the failure must name rank 1 and its error.
"""

import tp_ranks
from test_week_4_day_2 import RANKS, launch_checks, problem


def test_a_rank_that_dies_fails_the_run_naming_it(impl, tmp_path):
    found = launch_checks(impl, tmp_path, "--die-on-rank", "1", timeout=240)
    assert "timed out" not in found["output"], (
        f"the launch ran to its time limit: a rank waited for the dead one\n{found['output']}"
    )
    first = tp_ranks.CHECKS[0].__name__
    message = problem(found, first)
    assert message is not None and message.startswith(f"rank 1 of {RANKS} died in {first}"), (
        f"the failure must name rank 1, which died: {message}\n{found['output']}"
    )
    assert "told to die" in message, message

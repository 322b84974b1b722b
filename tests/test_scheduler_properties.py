"""The scheduler under random load (issue 24): property-based tests of batch_generate.

Not a course day (the skeleton need not pass it): hypothesis draws traces and settings, and
tests/scheduler_fuzz.py runs each and checks every property (see its docstring). A fixed seed
(derandomize) keeps CI repeatable; a failure is shrunk to a minimal Example, printed ready to
paste into a regression test below. `pdm run fuzz-scheduler --examples N` runs the same search
for as long as asked.

The named tests at the end are the failures the search has found, kept as plain examples.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from scheduler_fuzz import FAULT_SITES, Example, Fuzz, check_example, examples

# Sized to keep this file under two minutes on two cores with the reference.
CI = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,  # a seed fixed by the test's name: every CI run draws the same examples
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzz(impl, tmp_path_factory):
    return Fuzz(impl, tmp_path_factory.mktemp("fuzz"))


# A passing run takes well under a minute; a failing one also shrinks the failure, which
# takes minutes more (each shrink step runs the model): the limit leaves room for that.
SHRINK_TIME = pytest.mark.timeout(900)


@SHRINK_TIME
@CI
@given(ex=examples())
def test_every_policy_and_pool_kind(fuzz, ex):
    check_example(fuzz, ex)


@SHRINK_TIME
@settings(CI, max_examples=120)
@given(ex=examples(pools=("paged", "in-place"), pressure=True))
def test_under_memory_pressure(fuzz, ex):
    """Tight pools and small budgets: chunks, decode rows and admissions compete for pages."""
    check_example(fuzz, ex)


# --- regressions: failures the search found --------------------------------------------------

# Issue 24, shrunk by the search from a run of the code before the fix: plan_pass sized the
# chunk by every free page, including the pages make_room had just freed for the decode rows,
# and the pass died with PagePoolExhausted (the pool of 8 one-token pages is full).
HYBRID_CHUNK_TAKES_DECODE_PAGES = Example(
    prompts=[[0], [0, 0, 0], [0, 0, 0]],
    max_new_tokens=[1, 4, 1],
    policy="hybrid",
    batch_size=2,
    prefill_step=2,
    pool="paged",
    page_size=1,
    max_pages=8,
    headroom=0,
)


@pytest.mark.parametrize("pool, kv_bits", [("paged", None), ("in-place", None), ("paged", 8)])
def test_a_hybrid_chunk_leaves_the_decode_rows_their_pages(fuzz, pool, kv_bits):
    ex = dataclasses.replace(HYBRID_CHUNK_TAKES_DECODE_PAGES, pool=pool, kv_bits=kv_bits)
    check_example(fuzz, ex)


# --- the checks themselves, on fixed examples -------------------------------------------------

PRESSED = Example(
    prompts=[[7] * 9, [3] * 14, [5] * 4, [11] * 20],
    max_new_tokens=[6, 9, 12, 5],
    ignore_eos=True,
    policy="hybrid",
    batch_size=3,
    prefill_step=6,
    pool="paged",
    page_size=4,
    max_pages=8,
    headroom=0,
)


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("site", FAULT_SITES)
def test_a_fault_anywhere_returns_every_page(fuzz, policy, site):
    """A fault early, midway and late in a run that preempts: every page comes back."""
    assert check_example(fuzz, dataclasses.replace(PRESSED, policy=policy)).preemptions
    for at in (1, 7, 19):
        ex = dataclasses.replace(PRESSED, policy=policy, fault=site, fault_at=at)
        assert check_example(fuzz, ex).faulted, f"no fault at {site} {at}"


def test_a_request_larger_than_the_pool_is_refused_and_named(fuzz):
    """The 20-token prompt needs 7 pages of 4 at its longest, the pool has 6: refused, the
    others served as alone (check_results checks the refusal names it)."""
    ex = dataclasses.replace(PRESSED, max_pages=6)
    assert ex.too_large() == {3}
    check_example(fuzz, ex)

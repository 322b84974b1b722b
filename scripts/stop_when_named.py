"""A pytest plugin for check-course's one-stub runs: the run stops at the first test whose
failure names the task in TINY_LLM_STOP_WHEN_NAMED, since that one failure is all the check
needs (the rest of the day's tests would only run the reference again)."""

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    task = os.environ.get("TINY_LLM_STOP_WHEN_NAMED")
    if task and report.failed and task in str(report.longrepr):
        item.session.shouldstop = f"a test failed naming {task!r}"

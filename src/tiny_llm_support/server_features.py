"""The agents' features of serve.py that a student's solution may not have yet (Week 4 Day 8):
logprobs, a grammar (response_format, an enforced tool call) and n answers forked from one
prefill.

A plain request needs none of the day's tasks, so `--solution tiny_llm` serves before they are
written. But a request that needs one would raise NotImplementedError inside an engine step,
and a step that raises fails every request in flight. So the engine process reaches each task
once at start-up (probe, on the smallest inputs, most of them stand-ins that a written task
never gets far with) and says in its "ready" message which features are missing; the HTTP side
then refuses a request that needs one with a 400 naming the day and the task (refusal), before
the engine sees it. A task that raises anything else counts as written: its bugs are the day's
tests' to find (and containment's, at serving time).
"""

from __future__ import annotations

import re
from types import ModuleType, SimpleNamespace
from typing import Any

TASK = re.compile(r"Week \d+ Day \d+, Task \d+")
FEATURES = ("logprobs", "grammar", "choices")


def probe(package: ModuleType, shares_pages: bool, speculative: bool) -> dict[str, str]:
    """{feature: why it is missing} for "logprobs", "grammar" and "choices"; {} when every
    task a request can reach is written. `shares_pages`: the pools share pages (prefix cache
    on), so n > 1 forks (without sharing, each answer prefills and needs no task of the day);
    `speculative`: a grammar also goes through Task 4."""
    import mlx.core as mx

    so = package.structured_output
    tasks = {
        "logprobs": [
            ("token_logprobs", lambda: package.logprobs.token_logprobs(mx.zeros((1, 2)), [0], 1))
        ],
        "grammar": [
            ("mask_rows", lambda: so.mask_rows(mx.zeros((1, 2)), [mx.array([True, False])])),
            ("Grammar.advance", lambda: so.Grammar.advance(_stand_in_grammar(), 0)),
        ],
        "choices": [],
    }
    if speculative:
        tasks["grammar"].append(
            ("Grammar.guess_masks", lambda: so.Grammar.guess_masks(_stand_in_grammar(), []))
        )
    if shares_pages:
        cache = package.paged_kv_cache.TinyKvPagedCache
        tasks["choices"] += [
            ("copy_on_write", lambda: cache.copy_on_write(_stand_in_cache())),
            ("fork_prefix", lambda: package.fork.fork_prefix(_stand_in_fork(), _stand_in_fork())),
        ]
    missing = {}
    for feature, calls in tasks.items():
        for name, call in calls:
            problem = _unwritten(call, name, package.__name__)
            if problem is not None:
                missing[feature] = problem
                break
    return missing


def _unwritten(call: Any, name: str, package: str) -> str | None:
    """Why the task is not written yet, or None (it ran, or failed some other way)."""
    try:
        call()
    except NotImplementedError as e:
        found = TASK.search(str(e))
        task = found[0] if found else "a task of Week 4 Day 8"
        return f"{task} ({name}) is not written yet in {package}"
    except Exception:
        pass
    return None


def _stand_in_grammar() -> Any:
    """A Grammar's state: a matcher that takes every token and allows both of two."""
    matcher = SimpleNamespace(
        consume_token=lambda token: True,
        compute_bitmask=lambda: b"\x03",
        rollback=lambda n: None,
        validate_tokens=lambda tokens: len(tokens),
    )
    return SimpleNamespace(matcher=matcher, vocab_size=2, eos_token=1, allowed=lambda: None)


def _stand_in_cache() -> Any:
    """A paged cache over a pool with no free page: copy on write stops at its allocation."""
    pool = SimpleNamespace(allocate=_no_free_page, page_size=2, refs={})
    return SimpleNamespace(pool=pool, page_table=[0], _offset=1)


def _no_free_page() -> int:
    raise RuntimeError("the stand-in pool has no free page")


def _stand_in_fork() -> Any:
    """A request of one prompt token and no layers: nothing to share."""
    return SimpleNamespace(prompt_tokens=[0], kv_cache=[], entries=[], offset=0)


def refusal(missing: dict[str, str], params: Any, n: int, enforced_call: bool) -> tuple | None:
    """(field, message) for a request that needs a feature in `missing` (probe's): its
    SamplingParams, n, and whether its grammar is a tool call's (else response_format's)."""
    needs = {}
    if params.logprobs is not None:
        needs["logprobs"] = "logprobs"
    if params.grammar is not None:
        needs["grammar"] = "tool_choice" if enforced_call else "response_format"
    if n > 1:
        needs["choices"] = "n"
    for feature, field in needs.items():
        if feature in missing:
            return field, f"'{field}' needs {missing[feature]} (--solution ref serves it)"
    return None

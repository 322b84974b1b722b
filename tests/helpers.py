"""What the Week 2+ day tests share: the check of a generation loop's arguments; prompts of an exact token count, spies on the model, the
tokenizer and the caches, a log of on_step events, and the fault the tests inject. And for the
tests of the demo scripts and the benchmarks: an environment with no network and nothing of the
user's, and a benchmark module loaded by its path.

    from helpers import Injected, ModelSpy, prompt_with_tokens, ...
"""

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

# Two ranks need MLX's ring backend. Where it is missing, the two-rank tests skip and say why;
# with TINY_LLM_REQUIRE_RANKS=1 (set by .ci/run) they must run, and fail instead of skipping.
REQUIRE_RANKS = os.environ.get("TINY_LLM_REQUIRE_RANKS") == "1"


def assert_bad_prompts_refused(generate, model, prompt: list[int]) -> None:
    """generate(model, tokens, max_tokens) with no prompt tokens, then with max_tokens=-1:
    each a ValueError before any token (Week 1 Day 6 and Week 2 Day 1 call _check_prompt)."""
    for tokens, max_tokens in (([], 4), (prompt, -1)):
        with pytest.raises(ValueError, match="prompt has no tokens|max_tokens must be"):
            list(generate(model, tokens, max_tokens))
            pytest.fail(
                f"{len(tokens)} prompt tokens, max_tokens={max_tokens}: no ValueError; call the "
                "given _check_prompt(prompt_tokens, max_tokens) first"
            )


def ranks_cannot_start(reason: str):
    """Skip (fail under TINY_LLM_REQUIRE_RANKS=1) a test that needs two ranks."""
    message = f"two ranks cannot start on this machine: {reason}"
    if REQUIRE_RANKS:
        pytest.fail(f"{message} (TINY_LLM_REQUIRE_RANKS=1: the two-rank tests must run)")
    pytest.skip(message)


needs_ring = pytest.mark.skipif(
    not mx.distributed.is_available("ring") and not REQUIRE_RANKS,
    reason="this MLX build has no ring backend, so two ranks cannot start",
)

# A fixed text whose prefixes give every token count the tests need.
CORPUS = (
    "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 3
)


def prompt_with_tokens(tokenizer, n: int) -> str:
    """The shortest prefix of CORPUS that the tokenizer encodes to exactly n tokens."""
    for end in range(1, len(CORPUS) + 1):
        if len(tokenizer.encode(CORPUS[:end])) == n:
            return CORPUS[:end]
    raise AssertionError(f"no prefix of the corpus has {n} tokens")


def kernel_tolerance(dtype, want: np.ndarray) -> float:
    """How far a Week 5 kernel may be from its oracle `want`: float32, MLX's tolerance; a half
    type, a few roundings of the output's size (the kernels accumulate in float32)."""
    if dtype == mx.float32:
        return 1e-4 * (1 + np.abs(want).max())
    eps = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
    return 4 * eps * (1 + np.abs(want).max())


def assert_close(actual: mx.array, expected: mx.array, what: str, atol=1e-4, rtol=1e-4) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(
        np.array(actual), np.array(expected), atol=atol, rtol=rtol, err_msg=what
    )


class Injected(Exception):
    """The fault the tests inject. Not a RuntimeError (NotImplementedError is one): anything
    else escaping the code under test is a real bug."""


@dataclass
class Call:
    """One model call as a ModelSpy saw it."""

    shape: tuple[int, ...]
    offset: object
    tokens: list
    cache: list

    @property
    def kind(self) -> str:
        """ "decode" for one token per row after a prompt, else "prefill"."""
        return "decode" if self.shape[1] == 1 and self.offset != 0 else "prefill"


class ModelSpy:
    """Stands in for a Qwen3Model: records every call, then delegates.

    fail_before(calls) -> True raises Injected instead of running the newest call;
    fail_after(calls) -> True raises Injected right after it ran (its caches are written).
    """

    def __init__(self, model, fail_before=None, fail_after=None):
        self._model = model
        self._fail_before, self._fail_after = fail_before, fail_after
        self.calls: list[Call] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, tokens, offset, cache, *args, **kwargs):
        self.calls.append(Call(tuple(tokens.shape), offset, tokens.tolist(), cache))
        if self._fail_before is not None and self._fail_before(self.calls):
            raise Injected(f"before model call {len(self.calls)}")
        out = self._model(tokens, offset, cache, *args, **kwargs)
        if self._fail_after is not None and self._fail_after(self.calls):
            raise Injected(f"after model call {len(self.calls)}")
        return out

    def count(self, kind: str) -> int:
        return sum(call.kind == kind for call in self.calls)

    @property
    def decode_batch_sizes(self) -> list[int]:
        return [call.shape[0] for call in self.calls if call.kind == "decode"]


def nth_call_of(kind: str, n: int):
    """A fail_before / fail_after predicate: true at the n-th call of `kind`."""
    return lambda calls: calls[-1].kind == kind and sum(c.kind == kind for c in calls) == n


class TokenizerSpy:
    """Forwards to a tokenizer; may replace eos_token_ids, and may make the n-th detokenizer
    add_token call, counted over all requests, call on_fail() and raise Injected."""

    def __init__(self, tokenizer, eos_token_ids=None, fail_add_at=None, on_fail=lambda: None):
        self._tokenizer = tokenizer
        self.eos_token_ids = set(
            tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
        )
        self.fail_add_at, self.on_fail = fail_add_at, on_fail
        self.adds = 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def detokenizer(self):
        detok = self._tokenizer.detokenizer()
        add_token = detok.add_token

        def counted_add_token(token):
            self.adds += 1
            if self.adds == self.fail_add_at:
                self.on_fail()
                raise Injected(f"add_token call {self.adds}")
            return add_token(token)

        detok.add_token = counted_add_token
        return detok


class CacheTracker:
    """Records every per-layer cache the model hands out, and whether release() ran on it."""

    def __init__(self, monkeypatch, model):
        self.created = []  # one list of layer caches per request
        self.released = set()
        for name in ("create_kv_cache", "create_paged_kv_cache"):
            monkeypatch.setattr(model, name, self._wrap(getattr(model, name)))

    def _wrap(self, create):
        def tracked_create(*args, **kwargs):
            caches = create(*args, **kwargs)
            for layer_cache in caches:
                self._watch(layer_cache)
            self.created.append(caches)
            return caches

        return tracked_create

    def _watch(self, layer_cache):
        release = layer_cache.release

        def tracked_release():
            self.released.add(id(layer_cache))
            return release()

        layer_cache.release = tracked_release

    def assert_all_released(self):
        for n, caches in enumerate(self.created):
            for layer, layer_cache in enumerate(caches):
                assert id(layer_cache) in self.released, (
                    f"the layer-{layer} cache of request cache #{n} was never released"
                )


class StepLog:
    """An on_step callback that keeps what each event showed (the occupants of the slots at
    that moment)."""

    def __init__(self):
        self.events = []  # the BatchStep objects, in order
        self.steps = []  # (kind, request, [requests in slots])
        self.finished = {}  # prompt_idx -> generated tokens

    def __call__(self, step):
        occupants = [r for r in step.slots if r is not None]
        self.events.append(step)
        self.steps.append((step.kind, step.request, occupants))
        if step.kind == "finish":
            self.finished[step.request.prompt_idx] = list(step.request.generated)

    def kinds(self):
        return [kind for kind, _, _ in self.steps]

    def max_occupancy(self):
        return max((len(occupants) for _, _, occupants in self.steps), default=0)


def release_all(cache) -> None:
    for layer_cache in cache:
        layer_cache.release()


def run_ranks(script, args: list[str], out_dir, ranks: int = 2, timeout: float = 300) -> dict:
    """Run `python script args...` as `ranks` processes under mlx.launch (ring backend, this
    machine). Each rank writes out_dir/rank<r>.json; returns {rank: its JSON or None} and the
    launch's combined output under "output"."""
    import json
    import subprocess
    from pathlib import Path

    from tiny_llm_support.launch import launch

    out_dir = Path(out_dir)
    log = out_dir / "launch.log"
    with open(log, "w") as output:
        try:
            status = launch([str(script), *args], ranks, timeout=timeout, output=output)
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout} s"
    found = {}
    for r in range(ranks):
        path = out_dir / f"rank{r}.json"
        found[r] = json.loads(path.read_text()) if path.is_file() else None
    found["output"] = f"mlx.launch exit status {status}; output:\n{log.read_text()[-4000:]}"
    return found


def rank_check_problems(
    script, args: list[str], out_dir, names: list[str], ranks: int = 2, timeout: float = 240
) -> list[str]:
    """Run a rank script's checks on `ranks` ranks (run_ranks) and return one line per check
    that failed on a rank. Skips (fails under TINY_LLM_REQUIRE_RANKS=1) where ranks cannot
    start; fails at once when a rank died, hung in a check (after every error the ranks
    recorded, it names the earliest check in `names` that a rank waits in: the later ones wait
    on it) or did not run every check in `names`."""
    try:
        found = run_ranks(script, args, out_dir, ranks, timeout=timeout)
    except FileNotFoundError as e:  # no mlx.launch
        ranks_cannot_start(str(e))
    problems, stuck, missing = [], [], []
    for rank in range(ranks):
        report = found[rank] or {}
        if report.get("init_error"):
            ranks_cannot_start(report["init_error"])
        if report.get("died"):
            pytest.fail(f"rank {rank} died: {report['died']}\n{found['output']}", pytrace=False)
        checks = report.get("checks", {})
        problems += [f"rank {rank}, {name}: {err}" for name, err in checks.items() if err]
        if report.get("running"):
            order = names.index(report["running"]) if report["running"] in names else len(names)
            stuck.append((order, rank, report["running"]))
        missing += [(rank, name) for name in names if name not in checks]
    if stuck:  # the earliest check a rank waits in points at the slip; later ones wait on it
        _, rank, check = min(stuck)
        pytest.fail(
            "".join(f"{problem}\n" for problem in problems)
            + f"rank {rank} never finished {check}: it waits in a collective that no other rank "
            "matches (a recv whose shape or sender differs from the send, or a rank that skipped "
            "a collective the others run); stuck: "
            + ", ".join(f"rank {r} in {name}" for _, r, name in sorted(stuck))
            + f"\n{found['output']}",
            pytrace=False,
        )
    if missing:
        pytest.fail(
            f"checks that did not run (rank, check): {missing}\n{found['output']}", pytrace=False
        )
    return problems


def assert_all_pages_free(pools, why: str) -> None:
    """Every page of every pool is back on its free list; the message names the leak."""
    in_use = [pool.num_in_use for pool in pools]
    assert not any(in_use), f"{why}: pages still in use, per pool (layer): {in_use}"


def assert_nothing_allocated(pools, why: str) -> None:
    handed_out = [pool.num_allocations for pool in pools]
    assert not any(handed_out), f"{why}: pages handed out, per pool (layer): {handed_out}"


def assert_pools_used(pools) -> None:
    handed_out = [pool.num_allocations for pool in pools]
    assert all(handed_out), f"some pools were never used (pages handed out: {handed_out})"


def offline_env(tmp_path: Path, **extra: str) -> dict:
    """os.environ for a demo run under tmp_path: no network, no user cache, no terminal, and no
    re-exec with OpenBLAS (the tiny model needs no fast BLAS)."""
    env = dict(os.environ)
    env.update(
        HOME=str(tmp_path / "home"),
        TINY_LLM_CACHE=str(tmp_path / "cache"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        TERM="dumb",
        TINY_LLM_NO_OPENBLAS="1",
        **extra,
    )
    return env


BENCHES = Path(__file__).resolve().parent.parent / "benches"


def load_bench(name: str):
    """The module benches.<name> (the repository goes on sys.path, as for `python -m benches`)."""
    if str(BENCHES.parent) not in sys.path:
        sys.path.insert(0, str(BENCHES.parent))
    return importlib.import_module(f"benches.{name}")


def serve_greedy(engine, prompts, max_tokens, check=None) -> dict[int, list[int]]:
    """Add every prompt to an Engine (greedy, ignoring EOS; max_tokens one budget for all or one
    per prompt), step until idle, calling check(engine) after every step; returns
    {prompt index: generated tokens}."""
    budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    package = importlib.import_module(type(engine).__module__.rpartition(".")[0])
    rids = {
        engine.add_request(p, package.SamplingParams(max_tokens=n, ignore_eos=True)): i
        for i, (p, n) in enumerate(zip(prompts, budgets))
    }
    got = {i: [] for i in rids.values()}
    for _ in range(2000):
        if not engine.has_work:
            break
        for out in engine.step():
            got[rids[out.request_id]] += out.token_ids
        if check is not None:
            check(engine)
    assert not engine.has_work, "the engine did not go idle"
    return got

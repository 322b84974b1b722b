"""The scheduler under random load (issue 24): what tests/test_scheduler_properties.py and
scripts/fuzz-scheduler.py share.

An Example is one batch_generate call: a trace (prompts as token ids, a max_new_tokens for
each, EOS or not, often all starting with the same tokens) and the settings (policy, budget,
batch size, pool kind and size, prefix cache on or off, headroom, query padding, compiled or
not, fp32 or INT8 KV, and maybe a fault injected at some point).
check_example runs it and checks every property:

- it ends: no exception but the documented refusal of a request larger than the pool;
- every request that is not refused generates exactly the tokens and text it generates alone
  (the oracle: the same weights and KV dtype, not compiled, batch size 1, an unbounded pool of
  the same kind, no padding; memoized);
- no forward pass holds more rows than the budget; under hybrid every decoding request gets a
  row in every pass until it finishes or is preempted;
- at the end every page is free, every cache that holds tokens released and every slot empty;
  after a fault injected at a random point (before or after a forward pass, in an on_step
  event, in the detokenizer) every page is free and every cache released too.

examples() is the hypothesis strategy that draws Examples. Its repr is an Example(...) call, so
a failure printed by hypothesis pastes into a regression test as it is:

    check_example(fuzz, Example(prompts=[[5, 1]], max_new_tokens=[3], ...))
"""

import dataclasses
import importlib
from contextlib import contextmanager
from dataclasses import dataclass, field

import hypothesis.strategies as st
from helpers import Injected, TokenizerSpy

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

MAX_PROMPT_TOKENS = 36  # past a page (at most 8 tokens) and past most budgets
MAX_NEW_TOKENS = 12
MAX_PROMPTS = 8
MAX_BUDGET = 32
MAX_SHARED_PREFIX = 15  # tokens in front of every prompt of an example
MAX_SEQ_LEN = 64  # above every prompt plus its new tokens: no request stops at max_seq_len
PROMPT_IDS = 256  # prompts use the byte tokens, which every byte-level vocabulary holds
EOS_EVERY = 6  # every 6th token id also ends a request, so that EOS happens often
FAULT_SITES = ("before_pass", "after_pass", "event", "token")


@dataclass(repr=False)
class Example:
    """One batch_generate call. pool: "dense", "paged" (pages gathered) or "in-place" (pages
    read where they lie, float only); max_pages None is an unbounded pool. fault: where an
    Injected exception is raised (see FAULT_SITES), at the fault_at-th time it is reached."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    ignore_eos: bool = False
    policy: str = "alternate"
    batch_size: int = 1
    prefill_step: int = 8
    pool: str = "dense"
    page_size: int = 4
    max_pages: int | None = None
    headroom: int = 1
    query_padding: bool = False
    kv_bits: int | None = None
    compiled: bool = False
    fault: str | None = None
    fault_at: int = 0
    prefix_cache: bool = False

    def __repr__(self) -> str:
        """Example(...) as Python that builds it, a prompt of one repeated id as [id] * n."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["prompts"] = "[" + ", ".join(map(compact, self.prompts)) + "]"
        shown = [f"{k}={v if k == 'prompts' else repr(v)}" for k, v in fields.items()]
        return "Example(\n    " + ",\n    ".join(shown) + ",\n)"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))  # hypothesis prints a failing example with this

    def pages(self, idx: int) -> int:
        """The pages prompt idx may hold at its longest (for a paged pool)."""
        longest = min(MAX_SEQ_LEN, len(self.prompts[idx]) + self.max_new_tokens[idx])
        return -(-longest // self.page_size)

    def too_large(self) -> set[int]:
        """The prompts the pool can never hold: these must be refused."""
        if self.pool == "dense" or self.max_pages is None:
            return set()
        return {i for i in range(len(self.prompts)) if self.pages(i) > self.max_pages}


def compact(ids: list[int]) -> str:
    return f"[{ids[0]}] * {len(ids)}" if len(set(ids)) == 1 and len(ids) > 3 else repr(ids)


# --- the model, the tokenizer and the oracle ------------------------------------------------


class Fuzz:
    """What every example of one package shares: the tiny checkpoint, a tokenizer whose EOS
    set is large (the random model rarely emits its real EOS), one model per (kv_bits,
    compiled), and the memoized oracle."""

    def __init__(self, impl, ckpt_dir):
        self.impl = impl
        self.ckpt = load_checkpoint(make_tiny_checkpoint(ckpt_dir, seed=0))
        vocab_size = self.ckpt.config.vocab_size
        assert vocab_size >= PROMPT_IDS, f"the tiny vocabulary has only {vocab_size} tokens"
        eos = set(self.ckpt.tokenizer.eos_token_ids) | set(range(0, vocab_size, EOS_EVERY))
        self.tokenizer = TokenizerSpy(self.ckpt.tokenizer, eos_token_ids=eos)
        self._models = {}
        self._alone = {}

    def model(self, kv_bits: int | None, compiled: bool):
        key = (kv_bits, compiled)
        if key not in self._models:
            # INT8 groups of 32: the tiny model's head_dim is 32
            quantized = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": 32}
            self._models[key] = self.impl.Qwen3Model(self.ckpt, compiled=compiled, **quantized)
        return self._models[key]

    def pools(self, ex: Example, model, max_pages: int | None):
        if ex.pool == "dense":
            return None
        in_place = ex.pool == "in-place"
        return model.create_kv_pools(
            ex.page_size, max_pages, read_in_place=in_place, prefix_cache=ex.prefix_cache
        )

    def alone(self, ex: Example, idx: int) -> tuple[list[int], str]:
        """(tokens, text) of prompt idx run on its own: the eager model, one slot, an
        unbounded pool of the example's kind, a budget that holds the prompt, no padding."""
        prompt, budget = ex.prompts[idx], ex.max_new_tokens[idx]
        page_size = None if ex.pool == "dense" else ex.page_size  # in-place tiles by page
        key = (tuple(prompt), budget, ex.ignore_eos, ex.kv_bits, ex.pool, page_size)
        if key not in self._alone:
            model = self.model(ex.kv_bits, compiled=False)
            log = EventLog()
            [(_, text)] = self.impl.batch_generate(
                model, self.tokenizer, [prompt], MAX_SEQ_LEN, 1, MAX_SEQ_LEN,
                pools=self.pools(ex, model, None), on_step=log, max_new_tokens=budget,
                ignore_eos=ex.ignore_eos, query_padding=False,
            )  # fmt: skip
            self._alone[key] = (log.finished[0], text)
        return self._alone[key]


# --- one run, watched -----------------------------------------------------------------------


class Runaway(Exception):
    """The run went on far longer than its requests can take: it would not have ended."""


class WatchedModel:
    """Stands in for the model of one run: counts forward passes, raises Injected at the
    chosen one, stops a runaway, and records every cache it hands out and its release.

    A pass is a call of the model (the alternate policy) or of its final norm, which the
    hybrid policy's ragged pass calls once (a call of the model uses its own norm)."""

    def __init__(self, model, fail_before: int = 0, fail_after: int = 0, max_passes=10**6):
        self._model = model
        self._fail_before, self._fail_after = fail_before, fail_after
        self._max_passes = max_passes
        self.passes = 0
        self.caches = []  # every per-layer cache handed out
        self.released = set()  # id() of those released

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _pass(self, run, *args, **kwargs):
        self.passes += 1
        if self.passes > self._max_passes:
            raise Runaway(f"more than {self._max_passes} forward passes")
        if self.passes == self._fail_before:
            raise Injected(f"before forward pass {self.passes}")
        out = run(*args, **kwargs)
        if self.passes == self._fail_after:
            raise Injected(f"after forward pass {self.passes}")
        return out

    def __call__(self, *args, **kwargs):
        return self._pass(self._model, *args, **kwargs)

    def norm(self, h):
        return self._pass(self._model.norm, h)

    def create_kv_cache(self):
        return self._track(self._model.create_kv_cache())

    def create_paged_kv_cache(self, pools):
        return self._track(self._model.create_paged_kv_cache(pools))

    def _track(self, caches):
        for layer_cache in caches:
            release = layer_cache.release

            def tracked_release(layer_cache=layer_cache, release=release):
                self.released.add(id(layer_cache))
                return release()

            layer_cache.release = tracked_release
            self.caches.append(layer_cache)
        return caches

    def unreleased(self) -> int:
        """Layer caches that hold tokens and were never released (a cache made for a request
        that never ran holds nothing, and needs no release)."""
        return sum(id(c) not in self.released and c.offset > 0 for c in self.caches)


@dataclass
class Event:
    """An on_step event as it was when reported (the request changes afterwards). slots:
    (request, generated tokens so far, prefill done, done) for every occupied slot."""

    kind: str
    forward_pass: int
    tokens: int
    detail: str
    request: object
    slots: list = field(default_factory=list)


class EventLog:
    """The on_step callback of a run: keeps every event, and raises Injected at event
    number raise_at (0: never)."""

    def __init__(self, raise_at: int = 0):
        self.events: list[Event] = []
        self.raise_at = raise_at
        self.finished = {}  # prompt_idx -> the tokens it generated

    def __call__(self, step):
        occupants = [(r, len(r.generated), r.is_prefill_done, r.is_done) for r in step.slots if r]
        self.events.append(
            Event(step.kind, step.forward_pass, step.tokens, step.detail, step.request, occupants)
        )
        if step.kind == "finish":
            self.finished[step.request.prompt_idx] = list(step.request.generated)
        if len(self.events) == self.raise_at:
            raise Injected(f"in on_step event {self.raise_at} ({step.kind})")

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


@contextmanager
def headroom(impl, pages: int):
    """memory_planning.HEADROOM_PAGES of the package under test set to `pages`, for a while."""
    module = importlib.import_module(f"{impl.__name__}.memory_planning")
    saved = module.HEADROOM_PAGES
    module.HEADROOM_PAGES = pages
    try:
        yield
    finally:
        module.HEADROOM_PAGES = saved


def pass_limit(ex: Example) -> int:
    """Far more forward passes than any schedule needs, preemptions included: a run past it
    has stopped making progress while looking busy."""
    tokens = sum(len(p) + n for p, n in zip(ex.prompts, ex.max_new_tokens))
    return 50 * tokens + 100


@dataclass
class Outcome:
    """What a checked example did: whether the injected fault fired, and how many passes and
    preemptions it ran (a measure of memory pressure)."""

    faulted: bool
    passes: int
    preemptions: int = 0


def check_example(fuzz: Fuzz, ex: Example) -> Outcome:
    """Run one example and assert every property (an AssertionError says which)."""
    model = fuzz.model(ex.kv_bits, ex.compiled)
    fail = {"before_pass": "fail_before", "after_pass": "fail_after"}
    watched = WatchedModel(
        model,
        max_passes=pass_limit(ex),
        **({fail[ex.fault]: ex.fault_at} if ex.fault in fail else {}),
    )
    log = EventLog(ex.fault_at if ex.fault == "event" else 0)
    fuzz.tokenizer.fail_add_at = ex.fault_at if ex.fault == "token" else None
    fuzz.tokenizer.adds = 0
    pools = fuzz.pools(ex, model, ex.max_pages)
    try:
        with headroom(fuzz.impl, ex.headroom):
            out = fuzz.impl.batch_generate(
                watched, fuzz.tokenizer, ex.prompts, MAX_SEQ_LEN, ex.batch_size,
                ex.prefill_step, pools=pools, on_step=log, max_new_tokens=ex.max_new_tokens,
                ignore_eos=ex.ignore_eos, query_padding=ex.query_padding, policy=ex.policy,
            )  # fmt: skip
    except Injected:
        check_cleanup(watched, pools, "after the injected fault")
        return Outcome(True, watched.passes)
    finally:
        fuzz.tokenizer.fail_add_at = None
    check_cleanup(watched, pools, "at the end")
    check_results(fuzz, ex, out, log)
    check_budget(ex, log)
    check_every_decode_row_runs(log, every_pass=ex.policy == "hybrid")
    last = log.events[-1] if log.events else None
    assert last is None or not last.slots, f"slots still occupied at the end: {last.slots}"
    return Outcome(False, watched.passes, len(log.of_kind("preempt")))


def check_cleanup(watched: WatchedModel, pools, when: str) -> None:
    in_use = [pool.num_in_use for pool in pools or []]
    assert not any(in_use), f"{when}: pages still in use, per pool (layer): {in_use}"
    left = watched.unreleased()
    assert not left, f"{when}: {left} layer caches hold tokens and were never released"


def check_results(fuzz: Fuzz, ex: Example, out, log: EventLog) -> None:
    """Exactly the prompts that cannot fit are refused, each naming itself; every other one
    has the tokens and text it gets alone."""
    refused = {e.request.prompt_idx: e.detail for e in log.of_kind("refuse")}
    assert set(refused) == ex.too_large(), (
        f"refused prompts {sorted(refused)}, but only {sorted(ex.too_large())} cannot fit "
        f"{ex.max_pages} pages of {ex.page_size} tokens"
    )
    for idx, detail in refused.items():
        assert f"prompt {idx} " in detail, f"the refusal of prompt {idx} must name it: {detail!r}"
    served = [i for i in range(len(ex.prompts)) if i not in refused]
    assert [idx for idx, _ in out] == served, f"results for {[i for i, _ in out]}, not {served}"
    for idx, text in out:
        tokens, want = fuzz.alone(ex, idx)
        assert log.finished.get(idx) == tokens, (
            f"prompt {idx} generated {log.finished.get(idx)}, alone it generates {tokens}"
        )
        assert text == want, f"prompt {idx} wrote {text!r}, alone it writes {want!r}"


def check_budget(ex: Example, log: EventLog) -> None:
    """No pass holds more rows than the budget. Under hybrid the decode rows and the chunks of
    a pass count together, and a budget smaller than the decode rows leaves no room for a
    chunk (the decode rows still run: every decoding request gets its row in every pass);
    under alternate a chunk is a pass of its own, within the budget, and a decode pass holds
    at most one row per slot."""
    decode, chunk = {}, {}  # forward pass -> rows
    for e in log.events:
        if e.kind == "decode":
            assert e.tokens <= ex.batch_size, f"pass {e.forward_pass}: {e.tokens} decode rows"
            decode[e.forward_pass] = decode.get(e.forward_pass, 0) + e.tokens
        elif e.kind == "prefill":
            chunk[e.forward_pass] = chunk.get(e.forward_pass, 0) + e.tokens
    for n, rows in chunk.items():
        total = rows + (decode.get(n, 0) if ex.policy == "hybrid" else 0)
        assert total <= ex.prefill_step, (
            f"pass {n} holds {total} rows with its prompt chunks, more than the budget "
            f"{ex.prefill_step}"
        )


def check_every_decode_row_runs(log: EventLog, every_pass: bool) -> None:
    """A request decoding after one pass gets exactly one token in the next pass (in every
    pass under hybrid; under alternate in every decode pass, and none in a prefill pass)
    unless it is preempted in between; it may finish in that pass."""
    passes = passes_of(log)
    numbers = [p.number for p in passes]
    assert numbers == list(range(1, len(passes) + 1)), f"passes without rows: {numbers}"
    for before, after in zip(passes, passes[1:]):
        row = every_pass or after.kind == "decode"
        for rid, tokens in before.decoding().items():
            if rid in after.preempted_before:
                continue
            got = after.generated.get(rid)
            if got is None and rid in after.finished:  # under alternate it left its slot
                assert row, f"a decoding request finished in prefill pass {after.number}"
                continue
            want = tokens + 1 if row else tokens
            assert got == want, (
                f"a request decoding after pass {before.number} had {tokens} tokens; after "
                f"pass {after.number} ({after.kind}) it has {got}, expected {want}"
            )


@dataclass
class Pass:
    """One forward pass as the events show it: its number and kind ("decode" if it held a
    decode row), the slot occupants after its last prefill/decode event, the requests
    preempted just before it and the ones finished in it (by id)."""

    number: int
    kind: str = "prefill"
    occupants: list = field(default_factory=list)
    preempted_before: set = field(default_factory=set)
    finished: set = field(default_factory=set)

    @property
    def generated(self) -> dict:
        return {id(r): n for r, n, _, _ in self.occupants}

    def decoding(self) -> dict:
        """id -> tokens generated, for the occupants that will decode in the next pass."""
        return {id(r): n for r, n, prefilled, done in self.occupants if prefilled and not done}


def passes_of(log: EventLog) -> list[Pass]:
    """The passes in order. A finish event carries the number of the pass that made its last
    token (under alternate it comes before that decode pass's own event); a preempt event
    belongs to the plan of the next pass."""
    passes: dict[int, Pass] = {}
    preempted = set()
    for e in log.events:
        if e.kind in ("prefill", "decode", "finish") and e.forward_pass not in passes:
            passes[e.forward_pass] = Pass(e.forward_pass, preempted_before=preempted)
            preempted = set()
        if e.kind in ("prefill", "decode"):
            passes[e.forward_pass].occupants = e.slots
            if e.kind == "decode":
                passes[e.forward_pass].kind = "decode"
        elif e.kind == "preempt":
            preempted.add(id(e.request))
        elif e.kind == "finish":
            passes[e.forward_pass].finished.add(id(e.request))
    return list(passes.values())


# --- the strategy ---------------------------------------------------------------------------


@st.composite
def requests(draw) -> tuple[list[int], int]:
    """A prompt (its length drawn first: a plain list would rarely grow past a page) and its
    max_new_tokens."""
    length = draw(st.integers(1, MAX_PROMPT_TOKENS))
    ids = draw(st.lists(st.integers(0, PROMPT_IDS - 1), min_size=length, max_size=length))
    return ids, draw(st.integers(1, MAX_NEW_TOKENS))


POLICIES = ("alternate", "hybrid")
POOLS = ("dense", "paged", "in-place")


@st.composite
def examples(
    draw,
    policies=POLICIES,
    pools=POOLS,
    pressure: bool = False,
    compiled: bool = True,
    faults: bool = True,
) -> Example:
    """A random Example of the given policies and pool kinds. pressure: at least three
    prompts, two slots, a small budget and a tight pool, so that chunks, decode rows,
    admissions and preemptions compete for pages in most passes (where the hybrid plan's bugs
    live). Hypothesis draws the simplest values (the first choice, the lower bound) more often
    than the others, and shrinks towards them."""
    # one list of (prompt, max_new_tokens): the shrinker drops a request as one element
    trace = draw(st.lists(requests(), min_size=3 if pressure else 1, max_size=MAX_PROMPTS))
    prompts, max_new = [ids for ids, _ in trace], [n for _, n in trace]
    # a prefix every prompt starts with, so that a prefix cache (Week 4 Day 4) finds pages
    head = draw(st.lists(st.integers(0, PROMPT_IDS - 1), max_size=MAX_SHARED_PREFIX))
    prompts = [head + ids for ids in prompts]
    policy = draw(st.sampled_from(policies))
    batch_size = draw(st.integers(2 if pressure else 1, 4))
    small = st.integers(1, 12)  # many chunks per prompt, sharing passes with decode rows
    prefill_step = draw(small if pressure else st.one_of(small, st.integers(1, MAX_BUDGET)))
    kv_bits = draw(st.sampled_from([None, 8]))
    kinds = [k for k in pools if not (kv_bits and k == "in-place")]  # INT8 pages are gathered
    pool = draw(st.sampled_from(kinds or ["paged"]))
    page_size = draw(st.integers(1, 8)) if pool != "dense" else 4
    ex = Example(prompts, max_new, draw(st.booleans()), policy, batch_size, prefill_step, pool,
                 page_size)  # fmt: skip
    if pool != "dense":
        ex.max_pages = draw(pool_sizes(ex, pressure))
        ex.prefix_cache = draw(st.booleans())
    ex.headroom = draw(st.integers(0, 2))
    ex.query_padding = draw(st.booleans())
    ex.kv_bits = kv_bits
    # hypothesis draws the simplest value (0) often: make it the plain case
    ex.compiled = compiled and draw(st.integers(0, 9)) == 9  # compiling is slow: 1 in 10
    if faults and draw(st.integers(0, 3)) == 3:
        ex.fault = draw(st.sampled_from(FAULT_SITES))
        ex.fault_at = draw(st.integers(1, 40))
    return ex


def pool_sizes(ex: Example, pressure: bool):
    """Unbounded, or from a little below the smallest pool that holds the largest request
    (so that some requests are refused) up to one that holds every request at once."""
    smallest = max(ex.pages(i) for i in range(len(ex.prompts)))
    ample = sum(ex.pages(i) for i in range(len(ex.prompts))) + 2
    tight = st.integers(smallest, smallest + 4)  # preemptions, chunks short of pages
    if pressure:
        return tight
    return st.one_of(
        st.none(),
        tight,
        st.integers(smallest, max(smallest, ample)),
        st.integers(max(1, smallest - 2), smallest),
    )


def describe(ex: Example) -> str:
    """One line for progress output."""
    pages = "" if ex.pool == "dense" else f" pages {ex.max_pages}x{ex.page_size}"
    pages += ", prefix cache" if ex.prefix_cache else ""
    return (
        f"{len(ex.prompts)} prompts, {ex.policy}, budget {ex.prefill_step}, "
        f"batch {ex.batch_size}, {ex.pool}{pages}"
    )

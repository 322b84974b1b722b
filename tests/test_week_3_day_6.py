"""Week 3 Day 6: memory planning with a bounded page pool.

Task 1  can_admit: a prompt starts only when the free pages (less those owed to prompts
        already being prefilled) hold its pages plus the headroom.
Task 2  Request.preempt and make_room: the newest running requests give their pages back and
        wait at the front of the queue; they are prefilled again later.
Task 3  refusal: a request that cannot fit even in an empty pool is refused; the rest run.

Oracle: the same call with an unbounded pool. Preemption recomputes a request's cache from its
prompt and the tokens it had generated, so greedy output must not change by a single token.
"""

import importlib

import pytest
from helpers import Injected, StepLog, prompt_with_tokens

LENGTHS = (10, 12, 9, 14, 11, 8)
NEW_TOKENS = 12  # with pages of 4 tokens a request holds at most ceil(26 / 4) = 7 pages
MAX_PREEMPTIONS = 20  # per request: these traces need a few; more is a scheduler in a loop


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [prompt_with_tokens(tokenizer, n) for n in LENGTHS]


@pytest.fixture(scope="module")
def unbounded(impl, model, tokenizer, prompts):
    return impl.batch_generate(
        model, tokenizer, prompts, 64, 4, 8, pools=model.create_kv_pools(page_size=4),
        max_new_tokens=NEW_TOKENS,
    )  # fmt: skip


class PageAudit(StepLog):
    """A StepLog that checks every preemption as it happens: the pages in use are exactly those
    the page tables of the admitted, unfinished requests hold, so the victim's are back in the
    pool (a leak there only shows much later, as a scheduler that waits for pages forever)."""

    def __init__(self, pools):
        super().__init__()
        self.pools = pools
        self.live = []  # admitted, not finished, not preempted since
        self.preempted = {}  # prompt_idx -> times preempted

    def __call__(self, step):
        super().__call__(step)
        if step.kind == "preempt":
            times = self.preempted.get(step.request.prompt_idx, 0) + 1
            self.preempted[step.request.prompt_idx] = times
            assert times <= MAX_PREEMPTIONS, (
                f"prompt {step.request.prompt_idx} was preempted {times} times: the scheduler is "
                "going round in circles. A request that needs more pages than the whole pool "
                "pushes the others out and then itself, for ever: refusal (Task 3) must turn it "
                "away when it is added (its pages for prompt + max_new_tokens, rounded up, "
                "against max_pages)"
            )
        if step.kind == "admit":
            self.live.append(step.request)
        elif step.kind in ("finish", "preempt"):
            self.live = [r for r in self.live if r is not step.request]
        if step.kind == "preempt":
            victim = step.request
            kept = len(victim.kv_cache[0].page_table)
            held = sum(len(r.kv_cache[0].page_table) for r in self.live)
            in_use = self.pools[0].num_in_use
            assert kept == 0 and in_use == held, (
                f"prompt {victim.prompt_idx} was preempted but did not give its pages back: "
                f"{in_use} pages in use, the running requests hold {held}, the victim's page "
                f"table still lists {kept}. Request.preempt must release its caches "
                "(self.release()) before it waits to be prefilled again"
            )


def generate(impl, model, tokenizer, prompts, max_pages, policy, **kwargs):
    pools = model.create_kv_pools(page_size=4, max_pages=max_pages)
    log = PageAudit(pools)
    out = impl.batch_generate(
        model, tokenizer, prompts, 64, 4, 8, pools=pools, on_step=log,
        max_new_tokens=NEW_TOKENS, policy=policy, **kwargs,
    )  # fmt: skip
    return out, log, pools


# --- the whole day: a pool too small for every active request -------------------------------


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("max_pages", [12, 8, 7])
def test_a_small_pool_serves_everyone_with_the_same_text(
    impl, model, tokenizer, prompts, unbounded, policy, max_pages
):
    """Four slots of up to 7 pages each need 28 pages; the pool has 12, 8 or 7."""
    out, log, pools = generate(impl, model, tokenizer, prompts, max_pages, policy)
    assert out == unbounded, (
        f"{policy}, {max_pages} pages: every request must finish with the text it gets from an "
        "unbounded pool; a preempted request is prefilled again from its prompt plus the tokens "
        "it had generated (all but the last, which is its next decode input)"
    )
    assert "preempt" in log.kinds(), (
        f"{max_pages} pages cannot hold 4 requests: expected a preemption"
    )
    assert pools[0].peak_in_use <= max_pages
    assert [pool.num_in_use for pool in pools] == [0] * len(pools), "every page back at the end"


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("max_pages", [8, 10])
def test_the_newest_request_is_preempted_and_queued_first(
    impl, model, tokenizer, prompts, policy, max_pages
):
    """With 10 pages a request that finished early has handed its slot to a newer one, so the
    newest running request is not the one in the last slot."""
    out, log, _ = generate(impl, model, tokenizer, prompts, max_pages, policy)
    admitted = []  # requests running, in admission order
    for n, (kind, request, occupants) in enumerate(log.steps):
        if kind == "admit":
            admitted.append(request)
        elif kind == "finish" and request in admitted:
            admitted.remove(request)
        elif kind == "preempt":
            # the slots just before the preemption: this event's slots, and the victim
            running = [r for r in admitted if r is request or any(r is o for o in occupants)]
            assert request is running[-1], (
                f"{policy}: preempted prompt {request.prompt_idx}, but the most recently "
                f"admitted running request was prompt {running[-1].prompt_idx}: make_room "
                "picks the victim by its `admitted` count (the largest), not by its slot"
            )
            admitted.remove(request)
            # the next admission, unless another preemption puts its victim in front first
            following = [(k, r) for k, r, _ in log.steps[n + 1 :] if k in ("admit", "preempt")]
            assert following, f"prompt {request.prompt_idx} was never admitted again"
            kind, first = following[0]
            assert kind == "preempt" or first is request, (
                f"{policy}: preempted prompt {request.prompt_idx}, but prompt "
                f"{first.prompt_idx} was admitted next: a preempted request waits at the front "
                "of the queue (scheduler.preempt puts it there)"
            )


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_admission_waits_for_pages(impl, model, tokenizer, prompts, policy):
    """Every admission leaves the prompt's pages plus one page of headroom free."""
    pools = model.create_kv_pools(page_size=4, max_pages=8)
    seen = []

    def check(step):
        if step.kind == "admit":
            need = -(-len(step.request.prefill_tokens) // 4) + 1
            seen.append((step.request.prompt_idx, need, 8 - pools[0].num_in_use))

    impl.batch_generate(
        model, tokenizer, prompts, 64, 4, 8, pools=pools, on_step=check,
        max_new_tokens=NEW_TOKENS, policy=policy,
    )  # fmt: skip
    for idx, need, free in seen:
        assert need <= free, (
            f"prompt {idx} was admitted needing {need} pages (prompt + 1 headroom) with only "
            f"{free} free"
        )


def test_can_admit_counts_prompt_headroom_and_pages_owed(impl, model):
    module = importlib.import_module(f"{impl.__name__}.memory_planning")
    pools = model.create_kv_pools(page_size=4, max_pages=10)
    assert module.can_admit(35, 0, pools), "9 pages + 1 headroom fit 10 free pages"
    assert not module.can_admit(37, 0, pools), "10 pages + 1 headroom do not fit 10"
    assert not module.can_admit(20, 5, pools), (
        "5 pages + 1 headroom do not fit when 5 of the 10 free pages are owed to a prompt "
        "already being prefilled"
    )
    assert module.can_admit(10_000, 0, model.create_kv_pools(page_size=4)), "unbounded pool"


# --- a prompt chunk never takes pages that are not free -------------------------------------


def test_a_chunk_that_does_not_fit_waits_under_the_alternate_policy(
    impl, model, tokenizer, monkeypatch
):
    """Three requests decode while a 30-token prompt is prefilled in chunks of 4 from a pool of
    14 pages: their decode rows take the pages its next chunk needs, so the chunk must wait for
    an iteration (Scheduler.chunk_fits, given, asked in alternate_step) instead of running out
    of pages half way."""
    prompts = [prompt_with_tokens(tokenizer, n) for n in (3, 3, 3, 30)]
    answers = []
    real = impl.Scheduler.chunk_fits

    def chunk_fits(self, request):
        answers.append(real(self, request))
        return answers[-1]

    monkeypatch.setattr(impl.Scheduler, "chunk_fits", chunk_fits)

    def run(pools):
        return impl.batch_generate(
            model, tokenizer, prompts, 64, 4, 4, pools=pools, max_new_tokens=[30, 30, 30, 2],
            ignore_eos=True,
        )  # fmt: skip

    want = run(model.create_kv_pools(page_size=4))
    answers.clear()
    pools = model.create_kv_pools(page_size=4, max_pages=14)
    try:
        got = run(pools)
    except impl.PagePoolExhausted as e:
        pytest.fail(
            f"PagePoolExhausted ({e}): alternate_step ran a prompt chunk whose pages were not "
            "free. Ask self.chunk_fits(request) before each chunk: a chunk that does not fit "
            "waits for a later iteration, and the decode step runs (a chunk never preempts)",
            pytrace=False,
        )
    assert False in answers, (
        "alternate_step must ask self.chunk_fits(request) before it prefills a chunk (the test "
        f"expects a chunk that does not fit); chunk_fits answered {answers}"
    )
    assert got == want, "the texts of an unbounded pool"
    assert pools[0].peak_in_use <= 14 and pools[0].num_in_use == 0


# --- the hybrid plan spends only spare pages ------------------------------------------------


@pytest.mark.parametrize("headroom", [0, 1])
def test_a_hybrid_chunk_never_takes_the_pages_its_decode_rows_need(
    impl, model, tokenizer, prompts, unbounded, monkeypatch, headroom
):
    """Regression: plan_pass once sized a chunk by the free pages alone, after make_room had
    set them aside for the decode rows, and the pass died with PagePoolExhausted (headroom 0
    on a 12-page pool reaches it at once)."""
    module = importlib.import_module(f"{impl.__name__}.memory_planning")
    monkeypatch.setattr(module, "HEADROOM_PAGES", headroom)
    pools = model.create_kv_pools(page_size=4, max_pages=12)
    out = impl.batch_generate(
        model, tokenizer, prompts, 64, 4, 8, pools=pools, max_new_tokens=NEW_TOKENS,
        policy="hybrid",
    )  # fmt: skip
    assert out == unbounded, f"headroom {headroom}: the same text as an unbounded pool"
    assert pools[0].peak_in_use <= 12 and pools[0].num_in_use == 0


# --- refusal ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_a_request_larger_than_the_pool_is_refused_and_the_rest_run(
    impl, model, tokenizer, prompts, unbounded, policy
):
    huge = prompt_with_tokens(tokenizer, 30)  # 30 + 12 tokens: 11 pages > 8
    out, log, pools = generate(
        impl, model, tokenizer, [*prompts[:3], huge, *prompts[3:]], 8, policy
    )
    refused = [step for step in log.events if step.kind == "refuse"]
    assert len(refused) == 1, f"expected one refused request, events: {log.kinds()}"
    step = refused[0]
    assert step.request.prompt_idx == 3
    assert "11" in step.detail and "8" in step.detail, (
        f"the refusal must name the request's pages and the pool's: {step.detail!r}"
    )
    want = [(i if i < 3 else i + 1, text) for i, text in unbounded]
    assert out == want, (
        "the other requests run and keep their prompt_idx; the refused one has no result"
    )
    assert pools[0].num_allocations > 0 and pools[0].num_in_use == 0


def test_refusal_names_the_sizes(impl, model):
    module = importlib.import_module(f"{impl.__name__}.memory_planning")
    pools = model.create_kv_pools(page_size=4, max_pages=8)
    assert module.refusal(32, pools) is None, "32 tokens are exactly 8 pages: it fits"
    reason = module.refusal(33, pools)
    assert reason and "9" in reason and "8" in reason, f"33 tokens need 9 pages of 8: {reason!r}"
    assert module.refusal(10**6, model.create_kv_pools(page_size=4)) is None, "unbounded pool"


# --- faults ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_a_fault_during_a_re_prefill_returns_every_page(
    impl, model, tokenizer, prompts, monkeypatch, policy
):
    real = impl.Request.chunk_done
    resumed = []

    def failing(self, n):
        if self.generated:  # a chunk of a request that was preempted and is prefilled again
            resumed.append(self.prompt_idx)
            raise Injected("re-prefill")
        return real(self, n)

    monkeypatch.setattr(impl.Request, "chunk_done", failing)
    pools = model.create_kv_pools(page_size=4, max_pages=8)
    with pytest.raises(Injected):
        impl.batch_generate(
            model, tokenizer, prompts, 64, 4, 8, pools=pools, max_new_tokens=NEW_TOKENS,
            policy=policy,
        )  # fmt: skip
    assert resumed, "the fault should hit a re-prefill"
    assert [pool.num_in_use for pool in pools] == [0] * len(pools), "every page returned"

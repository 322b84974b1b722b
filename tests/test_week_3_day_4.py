"""Week 3 Day 4: stall-free batching.

Task 1  forward_ragged(model, tokens [1, T], segments): the rows of several requests in one
        forward pass; attention per segment against that request's own cache (over a page pool
        read in place, Week 3 Day 5's attend_in_place: its tests are that day's).
Task 2  hybrid_step: every iteration is one pass holding a row for every decoding request
        and prompt chunks filling the rest of the token budget (batch_generate policy="hybrid").

Oracles: a ragged pass equals running each request alone; hybrid generation equals each prompt
generated alone; the pass composition is checked through a spy on forward_ragged.
"""

import importlib
from collections import defaultdict

import mlx.core as mx
import pytest
from helpers import (
    CacheTracker,
    Injected,
    StepLog,
    TokenizerSpy,
    assert_close,
    prompt_with_tokens,
    release_all,
)

MAX_SEQ_LEN = 48
LENGTHS = (3, 9, 14, 22, 5, 30, 1)  # prompt token counts for the generation tests


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [prompt_with_tokens(tokenizer, n) for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(impl, model, tokenizer, prompts):
    """alone(max_new_tokens) -> the text each prompt generates on its own."""
    memo = {}

    def texts(max_new_tokens=None):
        if max_new_tokens not in memo:
            memo[max_new_tokens] = [
                impl.batch_generate(
                    model, tokenizer, [p], MAX_SEQ_LEN, 1, 512, max_new_tokens=budget
                )[0][1]
                for p, budget in zip(prompts, per_prompt(max_new_tokens, len(prompts)))
            ]
        return memo[max_new_tokens]

    return texts


def per_prompt(max_new_tokens, n):
    return list(max_new_tokens) if isinstance(max_new_tokens, tuple) else [max_new_tokens] * n


def make_caches(model, kind, n):
    """n fresh per-layer caches, dense or paged (pages of 4, gathered or read in place), and
    the pools (or None)."""
    if kind == "dense":
        return [model.create_kv_cache() for _ in range(n)], None
    pools = model.create_kv_pools(page_size=4, read_in_place=kind == "in place")
    return [model.create_paged_kv_cache(pools) for _ in range(n)], pools


# --- Task 1: a ragged forward pass ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "paged"])
@pytest.mark.parametrize("padding", [0, 3])
def test_ragged_pass_equals_each_request_alone(impl, model, tokenizer, kind, padding):
    """Two requests decoding (7 and 12 cached tokens), a third prefilling 5 tokens on top of 4
    cached ones, and a fourth starting its prompt: one ragged pass gives each of them the
    logits it gets alone, and leaves each cache exactly its own rows longer."""
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 30))
    cached, new = [7, 12, 4, 0], [1, 1, 5, 3]
    together, pools = make_caches(model, kind, 4)
    apart, apart_pools = make_caches(model, kind, 4)
    for caches in (together, apart):
        for cache, n in zip(caches, cached):
            if n:
                model(mx.array([ids[:n]]), 0, cache)
    rows = [ids[n : n + k] for n, k in zip(cached, new)]
    segments, tokens = [], []
    for cache, r in zip(together, rows):
        segments.append(impl.Segment(cache, len(tokens), len(r)))
        tokens += r
    tokens += [tokens[-1]] * padding  # rows after the last segment belong to no request
    logits = impl.forward_ragged(model, mx.array([tokens]), segments)
    assert logits.shape == (1, 4, model.config.vocab_size), "one logits row per segment"
    for i, (cache, r, n) in enumerate(zip(apart, rows, cached)):
        want = model(mx.array([r]), n, cache)[0, -1]
        assert_close(
            logits[0, i], want,
            f"segment {i} ({len(r)} rows at offset {n}) against the request alone (check the "
            "positions: each segment's cache offset, read before layer 0 appends; its own mask "
            "over its own cache; and that the attention outputs go back in segment order)",
        )  # fmt: skip
        assert together[i][0].offset == n + len(r), (
            f"segment {i}: its cache must grow by its own {len(r)} rows, no more "
            "(padding rows are written to no cache)"
        )
    for caches in (together, apart):
        for cache in caches:
            release_all(cache)
    for pool in (pools or []) + (apart_pools or []):
        assert pool.num_in_use == 0


def test_ragged_pass_returns_the_rows_asked_for(impl, model, tokenizer):
    """rows=[...]: the logits of those rows, each equal to the model's own row at that place."""
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 20))
    caches = [model.create_kv_cache(), model.create_kv_cache()]
    segments = [impl.Segment(caches[0], 0, 5), impl.Segment(caches[1], 5, 3)]
    logits = impl.forward_ragged(model, mx.array([ids[:5] + ids[10:13]]), segments, rows=[1, 4, 5])
    assert logits.shape == (1, 3, model.config.vocab_size), "one logits row per asked row"
    alone = [model(mx.array([ids[:5]]), 0, model.create_kv_cache())[0]]
    alone.append(model(mx.array([ids[10:13]]), 0, model.create_kv_cache())[0])
    for got, want, what in zip(logits[0], [alone[0][1], alone[0][4], alone[1][0]], [1, 4, 5]):
        assert_close(got, want, f"row {what} of the ragged pass, asked for with rows=")


def test_ragged_rows_attend_only_to_their_own_request(impl, model, tokenizer):
    """The same decode row next to different neighbours gives the same logits: no row may
    see another request's keys (a mask over the whole flattened batch would leak)."""
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 20))
    results = []
    for neighbour in ([5, 6, 7], [11, 12, 13, 14, 15, 16]):
        caches = [model.create_kv_cache(), model.create_kv_cache()]
        model(mx.array([ids[:9]]), 0, caches[0])
        segments = [
            impl.Segment(caches[1], 0, len(neighbour)),
            impl.Segment(caches[0], len(neighbour), 1),
        ]
        tokens = mx.array([neighbour + [ids[9]]])
        results.append(impl.forward_ragged(model, tokens, segments)[0, 1])
    assert_close(results[0], results[1], "a decode row beside two different prompt chunks")


# --- Task 2: the hybrid policy --------------------------------------------------------------


class PassSpy:
    """Replaces the stall_free module's forward_ragged: records every pass's segments as
    (id of the request's cache list, rows, cache offset before the pass), and the greedy token
    of each segment's logits row."""

    def __init__(self, impl, monkeypatch):
        module = importlib.import_module(f"{impl.__name__}.stall_free")
        self._forward = module.forward_ragged
        self.passes = []
        self.widths = []
        self.tokens = []  # per pass: the argmax of each segment's logits row, in segment order
        monkeypatch.setattr(module, "forward_ragged", self)

    def __call__(self, model, tokens, segments, rows=None):
        self.passes.append([(id(s.cache), s.length, s.cache[0].offset) for s in segments])
        self.widths.append(tokens.shape[1])
        logits = self._forward(model, tokens, segments, rows=rows)
        self.tokens.append(mx.argmax(logits[0], axis=-1).tolist())
        return logits


def run_hybrid(impl, model, tokenizer, prompts, budget, pools=None, **kwargs):
    log = StepLog()
    out = impl.batch_generate(
        model, tokenizer, prompts, MAX_SEQ_LEN, 3, budget, pools=pools, on_step=log,
        policy="hybrid", **kwargs,
    )  # fmt: skip
    return out, log


@pytest.mark.parametrize("budget", [1, 3, 16, 128, 512])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_hybrid_generates_what_each_prompt_generates_alone(
    impl, model, tokenizer, prompts, alone, monkeypatch, budget, paged
):
    pools = model.create_kv_pools(page_size=4) if paged else None
    spy = PassSpy(impl, monkeypatch)
    out, log = run_hybrid(impl, model, tokenizer, prompts, budget, pools)
    assert [t for _, t in out] == alone(), (
        f"budget {budget}: hybrid text differs from alone (the tests below name the likely "
        "slip: run pytest without -x, or look at test_each_request_gets_the_token_of_its_own_"
        "segment and test_ragged_pass_equals_each_request_alone)"
    )
    assert spy.passes, "policy='hybrid' must run its passes through forward_ragged"
    for n, segments in enumerate(spy.passes):
        rows = sum(length for _, length, _ in segments)
        assert rows <= budget, f"pass {n} holds {rows} rows, more than the budget of {budget}"
        assert len({c for c, _, _ in segments}) == len(segments), (
            f"pass {n} holds two segments of one request"
        )
    if pools is not None:
        assert all(pool.num_in_use == 0 for pool in pools), "pages left in use"


def test_every_decoding_request_gets_a_row_in_every_pass(
    impl, model, tokenizer, prompts, monkeypatch
):
    """Stall-free: once a request's prompt is in its cache, it decodes in every following pass
    until it is done: its decode rows sit in consecutive passes, one per generated token."""
    spy = PassSpy(impl, monkeypatch)
    out, log = run_hybrid(impl, model, tokenizer, prompts, 16)
    requests = {id(r.kv_cache): r for kind, r, _ in log.steps if r is not None}
    decode_passes = defaultdict(list)
    for n, segments in enumerate(spy.passes):
        for cache, length, offset in segments:
            request = requests[cache]
            if offset >= len(request.prompt_tokens):
                assert length == 1, "a decoding request gets exactly one row per pass"
                decode_passes[cache].append(n)
    for cache, request in requests.items():
        passes = decode_passes[cache]
        assert len(passes) == len(request.generated) - 1, (
            f"prompt {request.prompt_idx}: {len(request.generated)} tokens (the first from its "
            f"prefill) but {len(passes)} decode rows"
        )
        consecutive = list(range(passes[0], passes[0] + len(passes))) if passes else []
        assert passes == consecutive, (
            f"prompt {request.prompt_idx} decoded in passes {passes}: a decoding request must "
            "not skip a pass (a prompt chunk may never push decode rows out)"
        )


def test_prompts_take_a_slot_before_prefilling_and_group_when_the_budget_allows(
    impl, model, tokenizer, prompts
):
    out, log = run_hybrid(impl, model, tokenizer, prompts, 128)
    chunks_per_pass = defaultdict(set)
    for step in log.events:
        occupants = [r for r in step.slots if r is not None]
        assert len(step.slots) == 3 and len(occupants) <= 3
        if step.kind == "prefill":
            assert any(r is step.request for r in occupants), (
                f"prompt {step.request.prompt_idx} prefilled without holding a slot"
            )
            chunks_per_pass[step.forward_pass].add(step.request.prompt_idx)
    assert max(len(p) for p in chunks_per_pass.values()) >= 2, (
        "with a budget of 128 and short prompts, one pass should prefill several prompts "
        "(grouped prefill): when a prompt finishes inside the budget, admit the next one"
    )


@pytest.fixture(scope="module")
def traced(impl, model, tokenizer, prompts):
    """One hybrid run (budget 16, dense caches) with every pass, every event and every
    materialize() call recorded: (spy, [(event, passes run when it was reported)], {id of a
    layer cache: materialize calls})."""
    materialized = defaultdict(int)
    real = impl.TinyKvFullCache.materialize

    def counted(self):
        materialized[id(self)] += 1
        return real(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(impl.TinyKvFullCache, "materialize", counted)
        spy = PassSpy(impl, patch)
        events = []
        impl.batch_generate(
            model, tokenizer, prompts, MAX_SEQ_LEN, 3, 16, policy="hybrid",
            on_step=lambda step: events.append((step, len(spy.passes))),
        )  # fmt: skip
    return spy, events, materialized


def test_hybrid_events_carry_the_number_of_their_pass(traced):
    """scheduler.passes counts the forward passes; the prefill and decode events of a pass carry
    the number of the pass that did their work (1, 2, 3, ...), as under the alternate policy."""
    _, events, _ = traced
    for step, passes in events:
        if step.kind in ("prefill", "decode"):
            assert step.forward_pass == passes, (
                f"a {step.kind} event reported after pass {passes} carries forward_pass="
                f"{step.forward_pass}: hybrid_step must count its pass (scheduler.passes += 1) "
                "before it reports the pass's events"
            )
    kinds = [(s.forward_pass, s.kind) for s, _ in events if s.kind in ("prefill", "decode")]
    for (pass_a, kind_a), (pass_b, kind_b) in zip(kinds, kinds[1:]):
        assert not (pass_a == pass_b and (kind_a, kind_b) == ("decode", "prefill")), (
            f"pass {pass_a} reported a prefill event after its decode event: report the "
            '"prefill" event of each chunk first, then one "decode"'
        )


def test_every_decode_row_is_reported(traced):
    """Each pass with decode rows reports one "decode" event with their number, so the decode
    events of a run add up to every token generated after a request's first (which its last
    prefill chunk gave)."""
    _, events, _ = traced
    reported = sum(step.tokens for step, _ in events if step.kind == "decode")
    finished = [step.request for step, _ in events if step.kind == "finish"]
    decoded = sum(len(request.generated) - 1 for request in finished)
    assert reported == decoded, (
        f"the decode events count {reported} rows, the requests decoded {decoded} tokens after "
        'their first: after a pass with decode rows, scheduler.report("decode", None, '
        "len(decoding)) (the views and benchmarks count decode steps from these events)"
    )


def test_each_request_gets_the_token_of_its_own_segment(traced):
    """forward_ragged returns one logits row per segment, in the order of the segments: each
    decoding request (and each prompt finished by its chunk) takes the token of its own row."""
    spy, events, _ = traced
    requests = {id(step.request.kv_cache): step.request for step, _ in events if step.request}
    for n, (segments, tokens) in enumerate(zip(spy.passes, spy.tokens)):
        for i, (cache, length, offset) in enumerate(segments):
            request = requests[cache]
            prompt = len(request.prompt_tokens)
            if offset >= prompt:  # a decode row: its input is generated[offset - prompt]
                got, what = request.generated[offset - prompt + 1], "decoded"
            elif offset + length == prompt:  # the chunk that completes the prompt
                got, what = request.generated[0], "finished its prompt and got"
            else:
                continue
            if got != tokens[i]:
                other = [j for j, t in enumerate(tokens) if t == got and j != i]
                whose = f" (the token of segment {other[0]})" if other else ""
                pytest.fail(
                    f"pass {n + 1}: prompt {request.prompt_idx} {what} token {got}{whose}, but "
                    f"its own segment (segment {i} of {len(segments)}) gives {tokens[i]}: the "
                    "logits rows come back in the order of the segments, so hand the tokens out "
                    "in the order the rows were laid out (decode rows first, then the chunks)",
                    pytrace=False,
                )


def test_every_chunk_is_materialized(traced):
    """MLX is lazy: after each chunk's pass the request's caches are evaluated
    (request.materialize(), as try_prefill does), so no graph grows across chunks."""
    _, events, materialized = traced
    chunks = defaultdict(int)
    for step, _ in events:
        if step.kind == "prefill":
            chunks[step.request] += 1
    for request, n in chunks.items():
        calls = [materialized[id(layer_cache)] for layer_cache in request.kv_cache]
        assert min(calls) >= n, (
            f"prompt {request.prompt_idx} was prefilled in {n} chunks, but its layer caches "
            f"were materialized {calls} times: hybrid_step must call request.materialize() "
            "for every chunk of the pass"
        )


def test_hybrid_honours_per_request_budgets(impl, model, tokenizer, prompts, alone):
    budgets = (2, 5, 1, 9, 3, 4, 7)
    out, log = run_hybrid(impl, model, tokenizer, prompts, 16, max_new_tokens=list(budgets))
    assert [t for _, t in out] == alone(budgets)
    for i, budget in enumerate(budgets):
        assert len(log.finished[i]) == budget, f"prompt {i}: max_new_tokens={budget}"


def test_hybrid_on_a_compiled_model_pads_passes_to_the_ladder(
    impl, tiny_gqa_ckpt, tokenizer, prompts, alone, monkeypatch
):
    compiled = impl.Qwen3Model(tiny_gqa_ckpt, compiled=True)
    spy = PassSpy(impl, monkeypatch)
    out, _ = run_hybrid(impl, compiled, tokenizer, prompts, 12)
    assert [t for _, t in out] == alone()
    for segments, width in zip(spy.passes, spy.widths):
        decode_only = all(length == 1 and offset > 0 for _, length, offset in segments)
        allowed = {3} if decode_only else {4, 8, 12}
        assert width in allowed, (
            f"a compiled model's pass of {[s[1] for s in segments]} rows ran {width} wide: a pass "
            "with a prompt chunk is padded up the ladder of the budget 12 (4, 8, 12), a pass of "
            "decode rows alone up to the batch size 3"
        )


def test_unknown_policy_is_refused_before_any_cache(impl, model, tokenizer, monkeypatch):
    tracker = CacheTracker(monkeypatch, model)
    with pytest.raises(ValueError):
        impl.batch_generate(model, tokenizer, ["Hello"], policy="fastest")
    assert tracker.created == []


# --- faults ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["pass", "detokenize", "materialize"])
def test_a_fault_in_any_pass_returns_every_page(
    impl, model, tokenizer, prompts, monkeypatch, where
):
    pools = model.create_kv_pools(page_size=4)
    in_use = []

    def note():
        in_use.append(sum(pool.num_in_use for pool in pools))

    def fail_on(n, real):
        count = [0]

        def failing(*args):
            count[0] += 1
            if count[0] == n:
                note()
                raise Injected(f"{where}, call {n}")
            return real(*args)

        return failing

    tok = tokenizer
    if where == "pass":
        module = importlib.import_module(f"{impl.__name__}.stall_free")
        monkeypatch.setattr(module, "forward_ragged", fail_on(6, module.forward_ragged))
    elif where == "detokenize":
        tok = TokenizerSpy(tokenizer, fail_add_at=9, on_fail=note)
    else:
        real = impl.TinyKvPagedCache.materialize
        monkeypatch.setattr(impl.TinyKvPagedCache, "materialize", fail_on(9, real))
    with pytest.raises(Injected):
        run_hybrid(impl, model, tok, prompts, 8, pools)
    assert in_use and in_use[0] > 0, "the fault should hit while pages are in use"
    assert [pool.num_in_use for pool in pools] == [0] * len(pools), "every page returned"

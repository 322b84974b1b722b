"""Week 4 Day 5: speculative decoding. Guesses checked by one rectangular pass.

Task 1  lookup (prompt lookup) and DraftModel.propose: guesses from the request's own context,
        or from a smaller model with the same vocabulary and a cache of its own.
Task 2  accept_greedy: the longest prefix of the guesses the model agrees with, then the model's
        own next token.
Task 3  accept_sampled: keep a guess with probability min(1, p/q), replace the first rejected one
        by a draw from max(0, p - q): the output distribution is exactly p.
Task 4  speculative_step's check: every guess row scored in the ragged pass, the kept tokens
        accepted, the rows of rejected guesses rewound out of every cache (pages come back).

Oracles: the same engine without speculation (plain greedy decoding, token for token); a
chi-square test of the accept rule's output against p, whose false-failure rate is below 1e-5
per test (the seeds are fixed, so a run is reproducible); the pool's page counters.
"""

import importlib
import math
import random

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_all_pages_free, serve_greedy

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

MAX_SEQ_LEN = 96
PAGE = 4


def module(impl):
    return importlib.import_module(f"{impl.__name__}.speculative")


# --- Task 1: proposers -------------------------------------------------------------------------


def test_lookup_copies_what_followed_the_latest_occurrence(impl):
    context = [1, 2, 3, 9, 4, 1, 2, 3, 7, 5, 8, 1, 2, 3]
    assert impl.lookup(context, 3, 2) != [], (
        "no guess for [1, 2, 3], which occurred twice before: the tail itself always matches "
        "and nothing follows it, so look only at occurrences that start before it"
    )
    assert impl.lookup(context, 3, 2) == [7, 5], (
        "the last 3 tokens [1, 2, 3] occurred twice before: propose what followed the latest "
        "occurrence (at index 5), not the first"
    )
    assert impl.lookup(context, 3, 10) == [7, 5, 8, 1, 2, 3], "at most `most`, up to the end"
    assert impl.lookup([4, 5, 6, 8, 9, 6], 3, 2) == [8, 9], (
        "no earlier [8, 9, 6] or [9, 6]: fall back to the last token alone, [6] at index 2"
    )
    assert impl.lookup([4, 5, 6, 7], 3, 4) == [], "nothing occurred before: no guess"
    assert impl.lookup([3, 3], 2, 5) == [3], "the tail itself is not an earlier occurrence"
    assert impl.lookup(context, 3, 0) == [], "most=0: no guess"


def test_a_draft_with_another_vocabulary_is_refused(impl, model, tmp_path):
    other = load_checkpoint(make_tiny_checkpoint(tmp_path, seed=0, vocab_size=700))
    with pytest.raises(ValueError, match="vocabulary"):
        impl.DraftModel(impl.Qwen3Model(other), model)


def test_a_greedy_draft_guesses_its_own_greedy_continuation(impl, model, tokenizer):
    """The target as its own draft, greedy: the guesses are the model's greedy continuation,
    each guess run through the draft to get the next one's logits; for a request already
    prefilled too (its own cache holds the prompt, the draft's cache nothing yet)."""
    prompt = [5, 9, 13, 200, 44, 7]
    cache, inputs, want = model.create_kv_cache(), prompt, []
    for _ in range(4):
        logits = model(mx.array([inputs]), cache[0].offset, cache, logits_to_keep=1)
        want.append(mx.argmax(logits[0, -1]).item())
        inputs = want[-1:]
    assert len(set(want[:3])) > 1, f"the continuation {want} should not repeat one token"
    request = impl.Request(model, tokenizer, prompt)
    draft = impl.DraftModel(model, model, 3).propose(request, 3)
    assert draft.tokens == want[:3], (
        f"guesses {draft.tokens}, the model's greedy continuation {want[:3]}: after each guess, "
        "run it through the draft (at its cache's offset) and take the argmax of those logits"
    )
    request.release()
    request = impl.Request(model, tokenizer, prompt)
    while not request.is_prefill_done:  # its first token comes with the prefill's last chunk
        request.try_prefill()
    try:
        draft = impl.DraftModel(model, model, 3).propose(request, 3)
    except ValueError as e:
        raise AssertionError(
            f"propose failed for a request whose own cache holds {request.offset} tokens: {e}. "
            "The draft has a cache of its own, empty at first: run the context through the "
            "draft from the draft cache's offset, not the request's"
        ) from e
    done = len(request.generated)
    assert draft.tokens == want[done : done + 3], (
        f"guesses {draft.tokens} after a prefilled request's {request.generated}, the greedy "
        f"continuation {want[done : done + 3]}: the context is the prompt and the tokens generated"
    )
    request.release()


def test_a_sampled_draft_returns_the_probabilities_of_its_guesses(impl, model, tokenizer):
    """For a request that samples, DraftModel.propose draws each guess from the draft's own
    sampling probabilities and returns them: Draft.probs [k, V], each row a distribution
    that gives its guess a chance. The accept rule needs q; without it a guess counts as a
    point mass and the output distribution is no longer the target's."""
    params = impl.SamplingParams(temperature=0.8, seed=5)
    request = impl.Request(model, tokenizer, list(range(3, 12)), sampling=params)
    draft = impl.DraftModel(model, model, 3).propose(request, 3)
    assert draft.probs is not None, (
        "a sampled request's draft has no probs: return Draft(tokens, probs) with the "
        "probabilities each guess was drawn from"
    )
    probs = np.array(draft.probs)
    assert probs.shape == (3, model.config.vocab_size), f"Draft.probs {probs.shape}: [k, V]"
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-4, err_msg="rows of q")
    chances = [float(probs[i, token]) for i, token in enumerate(draft.tokens)]
    assert min(chances) > 0, f"q of each guess {chances}: a guess must come from its own row"
    request.release()


# --- Task 2: greedy acceptance -------------------------------------------------------------------


@pytest.mark.timeout(30)  # a loop that never advances fails here, not after 300 s
def test_greedy_acceptance_keeps_the_agreeing_prefix(impl):
    assert impl.accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7], (
        "guesses 5 and 6 agree with the model, 9 does not: keep 5, 6, then the model's 7"
    )
    assert impl.accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8], (
        "every guess agrees: keep them all and the model's token after the last one"
    )
    assert impl.accept_greedy([4, 6], [5]) == [4], "the first guess is wrong: only the model's"
    assert impl.accept_greedy([4], []) == [4], "no guess: one plain decoding step"
    assert impl.accept_greedy([5, 6, 7], [5, 1, 7]) == [5, 6], (
        "a guess after a rejected one never counts, even when it matches"
    )


# --- Task 3: the sampled accept rule ------------------------------------------------------------

P = [[0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1]]  # the target after row 0 and after row 1
Q = [0.1, 0.2, 0.3, 0.4]  # the draft's distribution for its one guess
TRIALS = 3000
CRITICAL = 26.0  # chi-square, 3 degrees of freedom: P(statistic > 26.0) < 1e-5 under the null


def chi_square(counts, probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def chi_square_sf_3(x):
    """P(chi-square with 3 degrees of freedom > x)."""
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)


def outcomes(accept, point_mass: bool, seed: int):
    """First and second tokens of TRIALS one-guess drafts through `accept`."""
    rng = random.Random(seed)
    key = [mx.random.key(seed)]

    def key_of():
        key[0], k = mx.random.split(key[0])
        return k

    p, q = mx.array(P), mx.array([Q])
    firsts, seconds = [0] * 4, [0] * 4
    for _ in range(TRIALS):
        guess = 2 if point_mass else rng.choices(range(4), weights=Q)[0]
        out = accept(p, guess, None if point_mass else q, key_of)
        firsts[out[0]] += 1
        if len(out) == 2:
            seconds[out[1]] += 1
    return firsts, seconds


def through(impl):
    draft_of = module(impl).Draft
    return lambda p, guess, q, key_of: impl.accept_sampled(p, draft_of([guess], q), key_of)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-model", "prompt-lookup"])
def test_sampled_acceptance_keeps_the_distribution_exact(impl, point_mass):
    firsts, seconds = outcomes(through(impl), point_mass, seed=11)
    stat = chi_square(firsts, P[0], TRIALS)
    assert stat < CRITICAL, (
        f"the first token came out {firsts} in {TRIALS} draws, p says {P[0]} (chi-square "
        f"{stat:.1f} > {CRITICAL}): keep a guess x with probability min(1, p(x) / q(x)) "
        "(q(x) = 1 for a prompt-lookup guess) and replace a rejected one by a draw from "
        "max(0, p - q), normalized"
    )
    kept = sum(seconds)
    assert kept > 0 and chi_square(seconds, P[1], kept) < CRITICAL, (
        f"after a kept guess the next token came out {seconds}, p of the next row says {P[1]}: "
        "when every guess is kept, draw one more token from the last row's p"
    )


def test_the_check_sees_a_biased_accept_rule(impl):
    """The same check has the power to catch the classic mistakes (accepting every guess,
    accepting exactly when p(x) > q(x)) while the rule under test passes it; its false-failure
    rate is below 1e-5."""
    assert chi_square_sf_3(CRITICAL) < 1e-5 < chi_square_sf_3(CRITICAL - 1)

    def always(p, guess, q, key_of):
        return [guess]

    def when_more_likely(p, guess, q, key_of):
        if p[0, guess].item() > q[0, guess].item():
            return [guess]
        residual = mx.maximum(p[0] - q[0], 0.0)
        return [mx.random.categorical(mx.log(residual), key=key_of()).item()]

    for rule in (always, when_more_likely, through(impl)):
        firsts, _ = outcomes(rule, point_mass=False, seed=12)
        stat = chi_square(firsts, P[0], TRIALS)
        if rule in (always, when_more_likely):
            assert stat > CRITICAL, f"{rule.__name__} went unnoticed (chi-square {stat:.1f})"
        else:
            assert stat < CRITICAL, f"accept_sampled failed with another seed: {firsts}"


# --- Task 4: inside the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tokenizer):
    rng = random.Random(0)
    base = [rng.randrange(3, 200) for _ in range(9)]
    return [base * 3, [rng.randrange(3, 200) for _ in range(14)], base + base[:4] + [7, 8]]


@pytest.fixture(scope="module")
def other_draft(impl, tmp_path_factory):
    """A draft of one layer with other weights: it often guesses wrong."""
    path = tmp_path_factory.mktemp("draft")
    return impl.Qwen3Model(load_checkpoint(make_tiny_checkpoint(path, seed=5, num_hidden_layers=1)))


def make_engine(impl, model, tokenizer, speculative, pools=None, batch_size=3, **kwargs):
    settings = dict(max_seq_len=MAX_SEQ_LEN, batch_size=batch_size, prefill_step=16)
    settings.update(kwargs)
    settings.setdefault("policy", "hybrid")
    return impl.Engine(model, tokenizer, pools=pools, speculative=speculative, **settings)


def proposers(impl, model, other_draft):
    return {
        "lookup-k1": lambda: impl.PromptLookup(1),
        "lookup-k2": lambda: impl.PromptLookup(2),
        "lookup-k4": lambda: impl.PromptLookup(4),
        "lookup-k8": lambda: impl.PromptLookup(8),
        "draft-same-k4": lambda: impl.DraftModel(model, model, 4),
        "draft-other-k2": lambda: impl.DraftModel(other_draft, model, 2),
    }


def no_pages_past_the_end(engine):
    """After a pass, every running request's caches hold exactly its tokens, and its page
    tables exactly the pages those need: rejected guesses took their pages with them. A draft
    model's own cache holds no more than the request's either: its rejected guesses are gone."""
    draft_caches = getattr(engine.speculative, "caches", {})  # DraftModel's, by prompt_idx
    for request in engine.scheduler.running():
        draft = draft_caches.get(request.prompt_idx)
        assert draft is None or draft[0].offset <= request.offset, (
            f"request {request.prompt_idx}: after the pass the draft model's cache holds "
            f"{draft[0].offset} tokens, the request's {request.offset}: keep_checked must call "
            "proposer.rewind(request), so that the draft forgets its rejected guesses too"
        )
        for cache in request.kv_cache:
            assert cache.offset == request.offset, (
                f"request {request.prompt_idx}: a layer cache holds {cache.offset} tokens, the "
                f"request {request.offset}: rewind every layer's cache past the rejected guesses"
            )
            if hasattr(cache, "page_table"):
                want = -(-cache.offset // cache.pool.page_size)
                assert len(cache.page_table) == want, (
                    f"request {request.prompt_idx}: {len(cache.page_table)} pages for "
                    f"{cache.offset} tokens: the pages of rejected guesses must go back"
                )


@pytest.mark.parametrize("cache", ["dense", "paged", "int8"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_speculation_generates_the_plain_tokens(
    impl, model, tokenizer, tiny_gqa_ckpt, prompts, other_draft, cache, batch_size
):
    target = model
    if cache == "int8":  # groups of 32: the tiny model's head_dim is 32
        target = impl.Qwen3Model(tiny_gqa_ckpt, kv_bits=8, kv_group_size=32)
    pools = lambda: None if cache == "dense" else target.create_kv_pools(page_size=PAGE)  # noqa: E731
    plain = serve_greedy(
        make_engine(impl, target, tokenizer, None, pools(), batch_size), prompts, 14
    )
    for name, make in proposers(impl, target, other_draft).items():
        proposer, engine_pools = make(), pools()
        engine = make_engine(impl, target, tokenizer, proposer, engine_pools, batch_size)
        got = serve_greedy(engine, prompts, 14, check=no_pages_past_the_end)
        assert got == plain, (
            f"{name}, {cache} caches, batch {batch_size}: greedy speculation generated other "
            "tokens than plain decoding; the guesses must be checked at the request's offset "
            "and only the agreeing prefix plus the model's own token kept"
        )
        if engine_pools:
            assert_all_pages_free(engine_pools, f"{name}: every request has ended")
        if name == "draft-same-k4":  # the target as its own draft guesses its greedy tokens
            assert proposer.accepted >= 0.8 * proposer.proposed, (
                f"{cache} caches, batch {batch_size}: the target model as its own draft had "
                f"{proposer.accepted} of {proposer.proposed} greedy guesses accepted (the "
                "reference: all): DraftModel.propose must take the argmax of the last row of "
                "each draft call's logits, the newest token's"
            )
    assert proposer.proposed > 0, "the proposers were meant to guess (test setup)"


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_the_alternate_policy_checks_guesses_apart_from_prompt_chunks(
    impl, model, tokenizer, prompts, other_draft, monkeypatch, cache
):
    """Under the alternate policy (3.1) a pass holds prompt chunks or decode rows with their
    guesses, never both, and the greedy text is the plain one."""
    mod = module(impl)
    passes, real = [], mod.check_pass

    def spy(scheduler, decoding, chunks, proposer):
        passes.append((len(decoding), len(chunks)))
        return real(scheduler, decoding, chunks, proposer)

    monkeypatch.setattr(mod, "check_pass", spy)
    pools = lambda: None if cache == "dense" else model.create_kv_pools(page_size=PAGE)  # noqa: E731
    plain = serve_greedy(make_engine(impl, model, tokenizer, None, pools()), prompts, 14)
    for make in (lambda: impl.PromptLookup(4), lambda: impl.DraftModel(other_draft, model, 2)):
        passes.clear()
        engine = make_engine(impl, model, tokenizer, make(), pools(), policy="alternate")
        got = serve_greedy(engine, prompts, 14, check=no_pages_past_the_end)
        assert got == plain, f"alternate policy, {cache} caches: other tokens than plain decoding"
        mixed = [p for p in passes if all(p)]
        assert not mixed, (
            f"passes with both decode rows and prompt chunks under the alternate policy: {mixed}"
        )
        assert any(d for d, _ in passes) and any(c for _, c in passes), f"passes {passes}"


def test_the_budget_counts_every_guess_row(impl, model, tokenizer, prompts, monkeypatch):
    mod = module(impl)
    widths, real = [], mod.forward_ragged

    def spy(model, tokens, segments, rows=None):
        widths.append(tokens.shape[1])
        return real(model, tokens, segments, rows)

    monkeypatch.setattr(mod, "forward_ragged", spy)
    engine = make_engine(impl, model, tokenizer, impl.PromptLookup(8), prefill_step=6)
    plain = serve_greedy(make_engine(impl, model, tokenizer, None, prefill_step=6), prompts, 14)
    assert serve_greedy(engine, prompts, 14) == plain
    assert widths and max(widths) <= 6, (
        f"passes of {max(widths)} rows with a budget of 6: a guess takes a row of the budget"
    )


class Oracle:
    """A proposer that knows the plain continuation and spoils every third guess."""

    num_draft_tokens = 3

    def __init__(self, impl, answers):
        self.draft_of, self.answers = module(impl).Draft, answers
        self.proposed = self.accepted = 0
        self.made = []

    def propose(self, request, most):
        context = request.prompt_tokens + request.generated
        answer = self.answers[tuple(request.prompt_tokens)]
        done = len(request.generated)
        guess = list(answer[done : done + most])
        if len(guess) == 3:
            guess[2] = (guess[2] + 1) % 200  # the third guess is always wrong
        self.made.append((len(guess), context))
        return self.draft_of(guess)

    def rewind(self, request):
        pass

    def forget(self, live):
        pass


def test_decode_events_count_every_token_a_pass_generates(impl, model, tokenizer, prompts):
    """A pass that keeps several tokens per request reports them all in its "decode" event,
    so the events add up to every token generated after a request's first."""
    events = []
    engine = make_engine(
        impl, model, tokenizer, impl.PromptLookup(4), batch_size=2, on_step=events.append
    )
    got = serve_greedy(engine, prompts, 14)
    reported = sum(e.tokens for e in events if e.kind == "decode")
    decoded = sum(len(tokens) - 1 for tokens in got.values())
    assert engine.stats()["tokens_accepted"] > 0, (
        "prompt lookup kept no guess on prompts that repeat themselves: is every decoding "
        "request's draft sent into the pass, and are agreeing guesses accepted?"
    )
    assert reported == decoded, (
        f"the decode events count {reported} tokens, the requests decoded {decoded} after "
        "their first: keep_checked returns the tokens generated (kept guesses and the model's "
        "own), which the pass reports"
    )


def test_acceptance_counters_are_exact(impl, model, tokenizer, prompts):
    plain = serve_greedy(make_engine(impl, model, tokenizer, None, batch_size=1), prompts[:1], 13)
    oracle = Oracle(impl, {tuple(prompts[0]): plain[0]})
    engine = make_engine(impl, model, tokenizer, oracle, batch_size=1)
    assert serve_greedy(engine, prompts[:1], 13) == plain
    # 13 tokens: 1 from the prefill; three passes guess 3 and keep 2 plus the model's own
    # (10 tokens); the last may guess only 2 (3 tokens are left, one is the model's), both right
    sizes = [n for n, _ in oracle.made]
    assert sizes == [3, 3, 3, 2], (
        f"guess sizes {sizes}: at most k, and at most the tokens left to generate less one"
    )
    stats = engine.stats()
    assert (stats["tokens_proposed"], stats["tokens_accepted"]) == (11, 8), (
        f"proposed/accepted {stats['tokens_proposed']}/{stats['tokens_accepted']}, expected "
        "11/8: three passes keep 2 of 3 guesses (the third is wrong), the last keeps 2 of 2"
    )


def a_late_new_token(impl, model, tokenizer) -> tuple[list[int], int, int]:
    """A prompt, and a token its greedy answer makes for the first time at place 2..8, and that
    place: made the EOS, it ends the answer inside a pass of 8 guesses that all agree. (The
    synthetic model mostly repeats one token, so the prompt is searched for, from one seed.)"""
    rng = random.Random(0)
    for _ in range(20):
        batch = [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
        plain = serve_greedy(make_engine(impl, model, tokenizer, None), batch, 10)
        for i, out in plain.items():
            for place in range(2, 9):
                if out[place] not in out[:place]:
                    return batch[i], out[place], place
    raise AssertionError("no greedy answer of 60 prompts makes a new token at place 2..8")


def test_eos_inside_the_kept_guesses_ends_the_request_there(impl, model, tokenizer):
    prompt, eos, place = a_late_new_token(impl, model, tokenizer)

    class WithEos:
        def __init__(self, tokenizer):
            self._tokenizer, self.eos_token_ids = tokenizer, {eos}

        def __getattr__(self, name):
            return getattr(self._tokenizer, name)

    params = impl.SamplingParams(max_tokens=20)
    ends = {}
    # the model as its own draft agrees with every guess: the EOS is one of 8 tokens kept at once
    speculations = {
        "plain": None,
        "lookup-k8": impl.PromptLookup(8),
        "draft-same-k8": impl.DraftModel(model, model, 8),
    }
    for name, speculative in speculations.items():
        engine = make_engine(impl, model, WithEos(tokenizer), speculative)
        engine.add_request(prompt, params)
        got = []
        while engine.has_work:
            for out in engine.step():
                got += out.token_ids
        ends[name] = got
    assert len(ends["plain"]) == place + 1 and ends["plain"][-1] == eos
    for name in ("lookup-k8", "draft-same-k8"):
        assert ends[name] == ends["plain"], (
            f"{name}: with speculation a request must end at its first EOS, even when it is one "
            "of several tokens kept in one pass: stop accepting at the token that ends the "
            f"request and drop the ones after it\n{name}: {ends[name]}\nplain: {ends['plain']}"
        )


def test_sampled_speculation_runs_and_frees_every_page(impl, model, tokenizer, prompts):
    pools = model.create_kv_pools(page_size=PAGE)
    engine = make_engine(impl, model, tokenizer, impl.DraftModel(model, model, 3), pools)
    params = impl.SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    got = {rid: [] for rid in rids}
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.token_ids
        no_pages_past_the_end(engine)
    assert all(len(tokens) == 10 for tokens in got.values())
    assert engine.stats()["tokens_accepted"] > 0, (
        "a draft with the target's own weights and temperature must have guesses accepted"
    )
    assert_all_pages_free(pools, "sampled speculation has ended")

"""Week 4 Day 3: serving. An engine that takes requests while it runs.

Task 1  Scheduler.remove: take a request out from any state (waiting, being prefilled,
        decoding, preempted); its slot and pages come back at once (Engine.abort).
Task 2  sample_rows: every row of a batch sampled with its own request's sampler; greedy rows
        are exactly the argmax.
Task 3  stop_cut: stop strings while streaming; text that may begin a stop string is held back,
        the stop string itself is never sent.

Oracles: simple_generate_with_kv_cache (Week 2 Day 1) with the 1.6 sampler, one prompt at a
time; the tokenizer's own decode; the page pool's counters.
"""

import importlib

import mlx.core as mx
import pytest
from helpers import assert_all_pages_free, prompt_with_tokens

from tiny_llm_support import load_checkpoint
from tiny_llm_support.models import tiny_chat_dir

MAX_SEQ_LEN = 64
LENGTHS = (10, 12, 9, 14, 11, 8)
NEW_TOKENS = 12
ARRIVALS = (0, 0, 1, 3, 4, 9)  # the step before which each prompt is added


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(prompt_with_tokens(tokenizer, n)) for n in LENGTHS]


def engine_for(impl, model, tokenizer, pools=None, policy="alternate", **kwargs):
    settings = dict(max_seq_len=MAX_SEQ_LEN, batch_size=4, prefill_step=8)
    settings.update(kwargs)
    return impl.Engine(model, tokenizer, pools=pools, policy=policy, **settings)


def alone(impl, model, tokens, params, eos=frozenset()):
    """The tokens one request generates on its own: the KV-cached loop of 2.1, with the 1.6
    sampler for its settings (the same seed gives the same draws)."""
    sampler = impl.make_sampler(params.temperature, params.top_k, params.top_p, params.seed)
    return list(
        impl.simple_generate_with_kv_cache(
            model, tokens, params.max_tokens, sampler, eos_token_ids=eos
        )
    )


def run(engine, arrivals, limit=500):
    """Add each (step, prompt, params) at its step, step until idle; returns
    {request id: (tokens, text, finish_reason)} and the outputs of every step."""
    got, steps, ids, n = {}, [], {}, 0
    while n < limit:
        for i, (at, prompt, params) in enumerate(arrivals):
            if at == n:
                ids[i] = engine.add_request(prompt, params)
        if n > max(at for at, _, _ in arrivals) and not engine.has_work:
            break
        outputs = engine.step()
        steps.append(outputs)
        for out in outputs:
            tokens, text, reason = got.get(out.request_id, ([], "", None))
            assert reason is None, f"request {out.request_id} has an output after its last one"
            got[out.request_id] = (tokens + out.token_ids, text + out.text, out.finish_reason)
        n += 1
    assert n < limit, f"the engine did not go idle in {limit} steps"
    return {i: got[rid] for i, rid in ids.items()}, steps


def greedy(impl, n=NEW_TOKENS):
    return impl.SamplingParams(max_tokens=n)


# --- arrivals while the engine runs ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("pool", ["dense", "paged", "small"])
def test_requests_arriving_at_any_step_get_the_text_they_get_alone(
    impl, model, tokenizer, prompts, policy, pool
):
    pools = None
    if pool != "dense":  # "small": 8 pages of 4 tokens for four slots of up to 7 pages
        pools = model.create_kv_pools(page_size=4, max_pages=8 if pool == "small" else None)
    engine = engine_for(impl, model, tokenizer, pools, policy)
    params = greedy(impl)
    got, _ = run(engine, [(at, p, params) for at, p in zip(ARRIVALS, prompts)])
    for i, prompt in enumerate(prompts):
        want = alone(impl, model, prompt, params)
        tokens, text, reason = got[i]
        assert tokens == want, (
            f"{policy}, {pool}: prompt {i}, added before step {ARRIVALS[i]}, generated other "
            "tokens than alone: a request added while others run must join the queue like any "
            "other and be prefilled from offset 0 into its own cache"
        )
        assert text == tokenizer.decode(want) and reason == "length"
    if pools:
        assert_all_pages_free(pools, f"{policy}: every request has ended")
    assert not engine.has_work and engine.stats()["running"] == 0


def test_batch_generate_is_a_loop_over_the_engine(impl, model, tokenizer, prompts, monkeypatch):
    module = importlib.import_module(f"{impl.__name__}.engine")
    steps = []
    real = module.Engine.step
    monkeypatch.setattr(module.Engine, "step", lambda self: steps.append(1) or real(self))
    out = impl.batch_generate(model, tokenizer, prompts[:2], MAX_SEQ_LEN, max_new_tokens=3)
    assert steps and len(out) == 2, "batch_generate adds every prompt and steps the Engine"


def test_finish_reasons_and_usage(impl, model, tokenizer, prompts):
    eos = alone(impl, model, prompts[0], greedy(impl, 4))[2]  # a token it surely generates
    spy = TokenizerWithEos(tokenizer, eos)
    engine = engine_for(impl, model, spy)
    got, steps = run(engine, [(0, prompts[0], greedy(impl, 10)), (0, prompts[1], greedy(impl, 3))])
    tokens, text, reason = got[0]
    assert reason == "stop" and tokens[-1] == eos, "EOS ends a request with finish_reason stop"
    assert text == tokenizer.decode(tokens[:-1]), "the EOS token's own text is never sent"
    assert got[1][2] == "length" and len(got[1][0]) == 3, "max_tokens ends it with length"
    last = [out for outputs in steps for out in outputs if out.finish_reason][-1]
    assert last.prompt_tokens in (len(prompts[0]), len(prompts[1]))
    assert last.completion_tokens == len(got[last.request_id][0])


class TokenizerWithEos:
    """The tokenizer, with `eos` as its only EOS token."""

    def __init__(self, tokenizer, eos):
        self._tokenizer, self.eos_token_ids = tokenizer, {eos}

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


# --- Task 1: abort from any state -----------------------------------------------------------


def state_of(engine, request):
    s = engine.scheduler
    if any(r is request for r in s.pending):
        return "preempted" if request.generated else "waiting"
    if s.prefilling is request or not request.is_prefill_done:
        return "prefilling"
    return "decoding"


def pages_of(request):
    cache = request.kv_cache[0]
    return len(cache.page_table)


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_any_state_returns_its_slot_and_pages_at_once(
    impl, model, tokenizer, prompts, policy, state
):
    # long prompts in chunks of 4 are seen half prefilled; 8 pages force preemptions
    pools = model.create_kv_pools(page_size=4, max_pages=8)
    engine = engine_for(impl, model, tokenizer, pools, policy, prefill_step=4)
    params = greedy(impl)
    ids = [engine.add_request(p, params) for p in prompts]
    requests = {rid: engine.streams[rid].request for rid in ids}
    victim, texts, steps = None, {rid: [] for rid in ids}, 0
    while engine.has_work and steps < 400:
        if victim is None:
            found = [rid for rid, r in requests.items() if state_of(engine, r) == state]
            if found and rid_alive(engine, found[-1]):
                victim = found[-1]
                request = requests[victim]
                in_use, held = pools[0].num_in_use, pages_of(request)
                engine.abort(victim)
                assert pools[0].num_in_use == in_use - held, (
                    f"abort of a {state} request must give its {held} pages back before it "
                    f"returns: {pools[0].num_in_use} in use, expected {in_use - held}"
                )
                assert all(r is not request for r in engine.scheduler.slots), (
                    f"an aborted {state} request must leave its slot"
                )
                assert all(r is not request for r in engine.scheduler.pending), (
                    f"an aborted {state} request must leave the queue"
                )
                rows = [row for layer in engine.scheduler.batch_cache for row in layer.slots]
                assert not any(row is mine for row in rows for mine in request.kv_cache), (
                    f"an aborted {state} request must leave the batch caches too, not only "
                    "scheduler.slots (Scheduler.vacate): the next request given its slot would "
                    "find it taken"
                )
        for out in engine.step():
            texts[out.request_id].append(out)
        steps += 1
    assert victim is not None, f"no request was ever {state} (the test's settings are wrong)"
    assert texts[victim][-1].finish_reason == "abort"
    for rid in ids:
        if rid != victim:
            got = [t for out in texts[rid] for t in out.token_ids]
            assert got == alone(impl, model, prompts[rid], params), (
                f"aborting request {victim} ({state}) changed the tokens of request {rid}"
            )
    assert_all_pages_free(pools, "every request has ended")
    assert engine.stats()["requests_aborted"] == 1


def test_abort_of_the_request_waiting_for_pages_forgets_it(impl, model, tokenizer, prompts):
    pools = model.create_kv_pools(page_size=4, max_pages=8)
    engine = engine_for(impl, model, tokenizer, pools, "hybrid", prefill_step=4)
    for p in prompts:
        engine.add_request(p, greedy(impl))
    for _ in range(200):
        waiting = engine.scheduler.waiting
        if waiting is not None and any(r is waiting for r in engine.scheduler.pending):
            break
        engine.step()
    else:
        raise AssertionError("no request waited for pages in 200 steps: admission ignores the pool")
    rid = next(rid for rid, stream in engine.streams.items() if stream.request is waiting)
    engine.abort(rid)
    assert engine.scheduler.waiting is None, (
        "remove() of the request waiting for pages must clear scheduler.waiting: the scheduler "
        "keeps no reference to a request it no longer holds"
    )
    run_until_idle(engine)
    assert_all_pages_free(pools, "every request has ended")


def rid_alive(engine, rid):
    return rid in engine.streams


def test_abort_of_an_unknown_or_finished_request_is_ignored(impl, model, tokenizer, prompts):
    engine = engine_for(impl, model, tokenizer)
    rid = engine.add_request(prompts[0], greedy(impl, 2))
    run_until_idle(engine)
    engine.abort(rid)
    engine.abort(12345)
    assert engine.step() == [] and not engine.has_work


def test_remove_of_a_request_the_scheduler_does_not_hold_changes_nothing(
    impl, model, tokenizer, prompts
):
    """Engine.abort never reaches Scheduler.remove for an unknown id, so remove is called here
    directly, with a request of the same pools that the scheduler never saw."""
    pools = model.create_kv_pools(page_size=4)
    engine = engine_for(impl, model, tokenizer, pools)
    stranger = impl.Request(model, tokenizer, prompts[0], pools=pools)
    stranger.try_prefill()  # it holds pages of its own
    in_use = pools[0].num_in_use
    try:
        removed = engine.scheduler.remove(stranger)
        assert removed is False, (
            f"remove() of a request the scheduler does not hold returned {removed!r}: it must "
            "return False and change nothing"
        )
        assert pools[0].num_in_use == in_use, (
            f"remove() of a request the scheduler does not hold left {pools[0].num_in_use} "
            f"pages in use, {in_use} before: release only the requests it takes out"
        )
    finally:
        stranger.release()


def run_until_idle(engine, limit=500):
    outputs = []
    for _ in range(limit):
        if not engine.has_work:
            return outputs
        outputs += engine.step()
    raise AssertionError(f"the engine did not go idle in {limit} steps")


# --- refusals: nothing allocated --------------------------------------------------------------


def test_bad_requests_are_refused_before_anything_is_allocated(impl, model, tokenizer, prompts):
    pools = model.create_kv_pools(page_size=4, max_pages=4)
    engine = engine_for(impl, model, tokenizer, pools)
    cases = [
        (impl.SamplingParams(temperature=-1.0), "temperature"),
        (impl.SamplingParams(top_p=0.0), "top_p"),
        (impl.SamplingParams(top_p=1.5), "top_p"),
        (impl.SamplingParams(max_tokens=0), "max_tokens"),
        (impl.SamplingParams(top_k=0), "top_k"),
        (impl.SamplingParams(seed=-1), "seed"),
    ]
    for params, field in cases:
        with pytest.raises(ValueError, match=field):
            engine.add_request(prompts[0], params)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request([1] * (MAX_SEQ_LEN + 1))
    with pytest.raises(ValueError, match="no tokens"):
        engine.add_request([])
    with pytest.raises(impl.RequestRefused, match="pages"):
        engine.add_request(prompts[0], greedy(impl, 20))  # 10 + 20 tokens: 8 pages > 4
    assert not engine.has_work and pools[0].num_allocations == 0, "nothing was allocated"


# --- Task 2: sampling per row ---------------------------------------------------------------


SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95)


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch(
    impl, model, tokenizer, prompts, policy
):
    seeded = [impl.SamplingParams(max_tokens=NEW_TOKENS, seed=s, **SAMPLED) for s in (7, 8, 9)]
    mix = [seeded[0], greedy(impl), seeded[1], greedy(impl), seeded[2], greedy(impl)]
    engine = engine_for(impl, model, tokenizer, policy=policy)
    got, _ = run(engine, [(at, p, q) for at, p, q in zip(ARRIVALS, prompts, mix)])
    for i, (prompt, params) in enumerate(zip(prompts, mix)):
        want = alone(impl, model, prompt, params)
        what = "greedy (temperature 0)" if params.temperature == 0 else f"seed {params.seed}"
        assert got[i][0] == want, (
            f"{policy}: request {i} ({what}) beside sampled and greedy requests drew other tokens "
            "than alone: each row must use its own request's sampler (its own key, called once "
            "per token it generates) and a temperature-0 row exactly the argmax"
        )
    assert got[0][0] != alone(impl, model, prompts[0], seeded[1]), "seeds 7 and 8 must differ"


def test_sample_rows_keeps_greedy_rows_exact_and_each_key_apart(impl):
    module = importlib.import_module(f"{impl.__name__}.sampler")
    logits = mx.random.normal((3, 50), key=mx.random.key(0))

    class Row:
        def __init__(self, sampler):
            self.sampler = sampler

    seeded = lambda: impl.SamplingParams(temperature=1.0, seed=3).sampler()
    rows = [Row(None), Row(seeded()), Row(None)]
    picked = module.sample_rows(logits, rows)
    argmax = mx.argmax(logits, axis=-1).tolist()
    assert picked[0] == argmax[0] and picked[2] == argmax[2], "greedy rows are the argmax"
    own = seeded()(logits[1:2]).item()
    assert picked[1] == own, "a sampled row is drawn by its own sampler from its own row"


# --- Task 3: stop strings while streaming -----------------------------------------------------


@pytest.fixture(scope="module")
def chat(impl):
    ckpt = load_checkpoint(tiny_chat_dir())
    model = impl.Qwen3Model(ckpt)
    tokenizer = ckpt.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is a KV cache?"}])
    return model, tokenizer, tokenizer.encode(text)


def test_stop_cut_holds_back_only_what_may_begin_a_stop(impl):
    assert impl.stop_cut("hello wor", ("world",)) == (6, False), "hold 'wor' back"
    assert impl.stop_cut("hello world!", ("world",)) == (6, True), "cut before the stop"
    assert impl.stop_cut("abcab", ("abd",)) == (3, False), "'ab' may begin 'abd'"
    assert impl.stop_cut("xay", ("ab", "yz")) == (2, False), "the longest held end of any stop"
    assert impl.stop_cut("an end", ("end", "an")) == (0, True), "the earliest stop wins"
    assert impl.stop_cut("plain", ()) == (5, False)
    assert impl.stop_cut("wo", ("world",)) == (0, False), "all of 'wo' may begin 'world': hold it"
    assert impl.stop_cut("\n", ("\n\n",)) == (0, False), "a lone newline may begin a blank line"
    assert impl.stop_cut("hello wx", ("world",)) == (8, False), (
        "'wx' begins no stop: hold back only an end of the text that equals a stop's beginning"
    )
    assert impl.stop_cut("xaa", ("aab",)) == (1, False), "'aa' may begin 'aab' ('a' alone too)"


def stream_with_stop(impl, chat, stop, policy="alternate"):
    model, tokenizer, prompt = chat
    engine = impl.Engine(model, tokenizer, max_seq_len=256, batch_size=2, policy=policy)
    params = impl.SamplingParams(max_tokens=60, stop=tuple(stop))
    rid = engine.add_request(prompt, params)
    other = engine.add_request(prompt, impl.SamplingParams(max_tokens=60))
    outputs = [out for out in run_until_idle(engine) if out.request_id == rid]
    return outputs, engine, other


@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_a_stop_string_split_across_tokens_ends_the_request_and_is_never_sent(impl, chat, policy):
    model, tokenizer, prompt = chat
    tokens = alone(impl, model, prompt, impl.SamplingParams(max_tokens=60), tokenizer.eos_token_ids)
    full = tokenizer.decode(tokens)
    # a stop string that starts inside one token and ends inside a later one
    ends = [len(tokenizer.decode(tokens[:k])) for k in range(1, len(tokens))]
    at = next(e for e in ends[3:] if e - 3 > 0 and full[e - 3 : e + 3].count(" ") <= 1)
    stop = full[at - 3 : at + 3]
    outputs, engine, _ = stream_with_stop(impl, chat, [stop], policy)
    sent = "".join(out.text for out in outputs)
    assert sent == full[: full.find(stop)], (
        f"stop {stop!r}: the text must end right before the stop string's first occurrence"
    )
    assert outputs[-1].finish_reason == "stop"
    for n in range(1, len(outputs) + 1):
        so_far = "".join(out.text for out in outputs[:n])
        assert stop not in so_far and full.startswith(so_far)
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize("where", ["middle", "end"])
def test_text_that_only_looks_like_a_stop_is_sent_in_the_end(impl, chat, where):
    model, tokenizer, prompt = chat
    tokens = alone(impl, model, prompt, impl.SamplingParams(max_tokens=60), tokenizer.eos_token_ids)
    full = tokenizer.decode(tokens).removesuffix("<|im_end|>")
    # its first characters occur (in the middle, or as the answer's last ones), the whole never
    stop = (full[10:16] if where == "middle" else full[-4:]) + "\u2603"
    outputs, _, _ = stream_with_stop(impl, chat, [stop])
    sent = "".join(out.text for out in outputs)
    assert sent == full, (
        f"held-back text that turned out not to be a stop string ({where}) must be sent when the "
        f"request ends, in its last output: sent {sent[-20:]!r} where the answer ends "
        f"{full[-20:]!r}"
    )
    held = [out for out in outputs if out.token_ids and not out.text]
    assert held, "while the text may still become the stop string, nothing of it is sent"


def test_a_character_split_across_tokens_is_never_sent_half(
    impl, model, tokenizer, prompts, monkeypatch
):
    """A sampler that plays a script of byte tokens: 'é', then an emoji of four byte tokens."""
    script = tokenizer.encode("é😀 ok é")
    played = iter(script)
    module = importlib.import_module(f"{impl.__name__}.sampler")
    monkeypatch.setattr(
        module.SamplingParams, "sampler", lambda self: lambda logits: mx.array([next(played)])
    )
    engine = engine_for(impl, model, tokenizer)
    rid = engine.add_request(prompts[0], impl.SamplingParams(max_tokens=len(script), seed=1))
    outputs = run_until_idle(engine)
    tokens = [t for out in outputs if out.request_id == rid for t in out.token_ids]
    assert tokens == script, (
        f"the request's own sampler was not used: it plays {script}, the engine generated "
        f"{tokens}. Each token must be drawn by its request's sampler, not taken as the argmax: "
        "sample_rows calls it, and your Week 3 decode_step, try_prefill and hybrid_step must "
        "pick their tokens with pick_tokens"
    )
    texts = [out.text for out in outputs if out.request_id == rid]
    assert all("\ufffd" not in t for t in texts), f"half a character was sent: {texts}"
    assert "".join(texts) == "é😀 ok é"


# --- a stuck scheduler is an error that names it, never a hang -----------------------------------


def test_a_finished_request_left_in_its_slot_is_named(impl, model, tokenizer, prompts, monkeypatch):
    """The classic hybrid_step slip: the request ends but keeps its slot (and would decode
    forever). The engine names it after the iteration instead of spinning."""
    module = importlib.import_module(f"{impl.__name__}.engine")
    real = module.hybrid_step

    def forgetful(scheduler, *args):
        held = list(scheduler.slots)
        real(scheduler, *args)
        for slot, request in enumerate(held):
            if request is not None and request.is_done:
                scheduler.slots[slot] = request

    monkeypatch.setattr(module, "hybrid_step", forgetful)
    with pytest.raises(RuntimeError, match="done but still holds slot"):
        impl.batch_generate(model, tokenizer, prompts, MAX_SEQ_LEN, 4, 8, max_new_tokens=2,
                            policy="hybrid")  # fmt: skip


def test_an_iteration_that_changes_nothing_is_an_error(
    impl, model, tokenizer, prompts, monkeypatch
):
    module = importlib.import_module(f"{impl.__name__}.scheduler")
    monkeypatch.setattr(module.Scheduler, "alternate_step", lambda self: None)
    pools = model.create_kv_pools(page_size=4)
    with pytest.raises(RuntimeError, match="made no progress"):
        impl.batch_generate(model, tokenizer, prompts, MAX_SEQ_LEN, 4, 8, pools=pools)
    assert_all_pages_free(pools, "after the error")

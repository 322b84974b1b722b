"""The served engine under random load: requests that arrive and are aborted at random steps.

Not a course day (the skeleton need not pass it). Hypothesis draws a trace (prompts, when each
arrives, when some are aborted, greedy or seeded sampling) and the engine's settings (policy,
budget, batch size, dense or paged, pool size, page size), runs it one step at a time, and
checks, for every example:

- it ends, with no exception but the refusal of a request larger than the pool at add_request;
- a request that is neither refused nor aborted generates exactly the tokens it generates
  alone; an aborted one generated a prefix of them and its last output says "abort";
- an abort gives the request's pages back before it returns;
- at the end every page is free, every slot empty, and the engine has no work.

A failure is shrunk to a minimal example and printed ready to paste as a regression test.
"""

import hypothesis.strategies as st
import pytest
from helpers import TokenizerSpy
from hypothesis import HealthCheck, given, settings

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

MAX_SEQ_LEN = 64
EOS_EVERY = 7  # every 7th token id also ends a request, so that EOS happens often
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9)

CI = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,  # the same examples in every CI run
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def setup(impl, tmp_path_factory):
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp("engine-fuzz"), seed=0))
    eos = set(ckpt.tokenizer.eos_token_ids) | set(range(0, ckpt.config.vocab_size, EOS_EVERY))
    return impl, impl.Qwen3Model(ckpt), TokenizerSpy(ckpt.tokenizer, eos_token_ids=eos), {}


@st.composite
def traces(draw):
    n = draw(st.integers(1, 6))
    prompts = [draw(st.lists(st.integers(0, 255), min_size=1, max_size=30)) for _ in range(n)]
    settings = dict(
        policy=draw(st.sampled_from(["alternate", "hybrid"])),
        batch_size=draw(st.integers(1, 4)),
        prefill_step=draw(st.integers(1, 32)),
        page_size=draw(st.one_of(st.none(), st.integers(1, 8))),  # None: dense caches
    )
    requests = []
    for prompt in prompts:
        seed = draw(st.one_of(st.none(), st.integers(0, 2**16)))  # None: greedy
        requests.append(
            dict(
                prompt=prompt,
                max_tokens=draw(st.integers(1, 10)),
                seed=seed,
                arrive=draw(st.integers(0, 12)),
                abort=draw(st.one_of(st.none(), st.integers(0, 25))),
            )
        )
    if settings["page_size"] is not None:
        largest = max(pages(r, settings["page_size"]) for r in requests)
        # from less than the largest request (it is refused) up to ample, or unbounded
        settings["max_pages"] = draw(st.one_of(st.none(), st.integers(max(1, largest - 1), 40)))
    return settings, requests


def pages(request, page_size):
    return -(-(len(request["prompt"]) + request["max_tokens"]) // page_size)


def params_of(impl, request):
    sampled = SAMPLED if request["seed"] is not None else {}
    return impl.SamplingParams(max_tokens=request["max_tokens"], seed=request["seed"], **sampled)


def make_pools(model, settings, bounded=True):
    if settings["page_size"] is None:
        return None
    limit = settings.get("max_pages") if bounded else None
    return model.create_kv_pools(page_size=settings["page_size"], max_pages=limit)


def alone(setup, settings, request) -> list[int]:
    """The tokens the request generates on its own: one slot, an unbounded pool of the same
    kind, the same sampling settings."""
    impl, model, tokenizer, memo = setup
    key = (tuple(request["prompt"]), request["max_tokens"], request["seed"], settings["page_size"])
    if key not in memo:
        engine = impl.Engine(
            model, tokenizer, MAX_SEQ_LEN, 1, MAX_SEQ_LEN, make_pools(model, settings, False)
        )
        engine.add_request(request["prompt"], params_of(impl, request))
        tokens = []
        while engine.has_work:
            tokens += [t for out in engine.step() for t in out.token_ids]
        memo[key] = tokens
    return memo[key]


def run_trace(setup, settings, requests):
    impl, model, tokenizer, _ = setup
    pools = make_pools(model, settings)
    engine = impl.Engine(
        model, tokenizer, MAX_SEQ_LEN, settings["batch_size"], settings["prefill_step"], pools,
        settings["policy"],
    )  # fmt: skip
    ids, got, ended, refused = {}, {}, {}, set()
    last_arrival = max(r["arrive"] for r in requests)
    for step in range(2000):
        for i, request in enumerate(requests):
            if request["arrive"] == step:
                try:
                    ids[i] = engine.add_request(request["prompt"], params_of(impl, request))
                except impl.RequestRefused:
                    refused.add(i)
            if request["abort"] == step and i in ids and ids[i] in engine.streams:
                abort_and_check(engine, pools, ids[i])
        if step > last_arrival and not engine.has_work:
            break
        for out in engine.step():
            assert out.request_id not in ended, f"request {out.request_id}: output after its last"
            got.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None:
                ended[out.request_id] = out.finish_reason
    else:
        raise AssertionError("the engine did not go idle in 2000 steps")
    return ids, got, ended, refused, engine, pools


def abort_and_check(engine, pools, rid):
    request = engine.streams[rid].request
    held = len(request.kv_cache[0].page_table) if pools else 0
    before = pools[0].num_in_use if pools else 0
    engine.abort(rid)
    if pools:
        assert pools[0].num_in_use == before - held, (
            f"abort of request {rid} must give back its {held} pages before it returns"
        )
    assert all(r is not request for r in engine.scheduler.slots), "an aborted request left a slot"


def check_trace(setup, settings, requests):
    ids, got, ended, refused, engine, pools = run_trace(setup, settings, requests)
    for i, request in enumerate(requests):
        if i in refused:
            assert pools and pages(request, settings["page_size"]) > settings["max_pages"], (
                f"request {i} was refused although it fits the pool"
            )
            continue
        want, tokens, reason = alone(setup, settings, request), got.get(ids[i], []), ended[ids[i]]
        if reason == "abort":
            assert tokens == want[: len(tokens)], f"aborted request {i}: not a prefix of alone"
        else:
            assert tokens == want, f"request {i} generated other tokens than alone"
    if pools:
        assert all(pool.num_in_use == 0 for pool in pools), "pages still in use at the end"
    assert not any(engine.scheduler.slots) and not engine.streams and not engine.has_work


@CI
@given(trace=traces())
def test_arrivals_and_aborts_at_random_steps(setup, trace):
    check_trace(setup, *trace)

"""Week 3 Day 1: continuous batching.

BatchingKvCache (Tasks 1-2), Request.try_prefill / decode_done (Tasks 3-4) and batch_generate
(Task 5). The oracle is Week 2's single-request greedy decoder: batching must not change a
single token. Prompts are prefilled whole here (prefill_step far above any prompt length);
chunked prefill is Week 3 Day 2.
"""

from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    CacheTracker,
    Injected,
    ModelSpy,
    StepLog,
    TokenizerSpy,
    assert_all_pages_free,
    assert_nothing_allocated,
    assert_pools_used,
    nth_call_of,
    prompt_with_tokens,
)

from tiny_llm_support.tokenizer import StreamingDetokenizer

MAX_SEQ_LEN = 40
WHOLE_PROMPT = 512  # prefill_step larger than every prompt: one prefill call per prompt

PROMPTS = [
    "Hello",  # 4 tokens
    "The quick brown fox jumps over the lazy dog.",  # 16
    "a",  # 1
    "How are you today?",  # 6
    "1, 2, 3",  # 5; greedy decoding gives 0, 82, 82, 82, 82, 383, ... (see EARLY_EOS)
    "def add(a, b):\n    return a + b",  # 15
    "naïve café 😀",  # 16, multi-byte characters
    "xyz",  # 3
]


# --- helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(impl, model, tokenizer):
    """oracle(prompt, max_seq_len, eos) -> the tokens one request alone generates greedily.

    Greedy decoding is deterministic, so a lower max_seq_len or more EOS ids only cut the
    same token sequence shorter: each prompt is decoded once, up to MAX_SEQ_LEN."""
    memo = {}

    def tokens_for(prompt, max_seq_len=MAX_SEQ_LEN, eos=None):
        """eos=None: the tokenizer's EOS ids; an empty set: decode straight past EOS."""
        ids = tokenizer.encode(prompt)
        assert max_seq_len <= MAX_SEQ_LEN
        if prompt not in memo:  # never stops at EOS, so every cut below can be taken from it
            memo[prompt] = list(
                impl.simple_generate_with_kv_cache(model, ids, MAX_SEQ_LEN - len(ids))
            )
        tokens = memo[prompt][: max_seq_len - len(ids)]
        stop_ids = tokenizer.eos_token_ids if eos is None else eos
        stops = [i for i, t in enumerate(tokens) if t in stop_ids]
        return tokens[: stops[0] + 1] if stops else tokens

    return tokens_for


def random_kv(rng, length, heads=2, dim=8):
    shape = (1, heads, length, dim)
    return (
        mx.array(rng.standard_normal(shape).astype(np.float32)),
        mx.array(rng.standard_normal(shape).astype(np.float32)),
    )


# --- Tasks 1-2: BatchingKvCache ------------------------------------------------------------


def test_add_and_remove_request_guard_slots(impl):
    batch = impl.BatchingKvCache(3)
    first, second = impl.TinyKvFullCache(), impl.TinyKvFullCache()
    batch.add_request(first, 2)
    batch.add_request(second, 0)
    assert batch.active_slots == [0, 2], "active_slots: the taken slots, in slot order"
    with pytest.raises(ValueError):
        batch.add_request(impl.TinyKvFullCache(), 2)  # taken
    with pytest.raises(ValueError):
        batch.add_request(impl.TinyKvFullCache(), 3)  # no such slot
    with pytest.raises(ValueError):
        batch.remove_request(1)  # empty
    for slot in (3, -1):  # no such slot: a ValueError, not an IndexError or the last slot
        with pytest.raises(ValueError):
            batch.remove_request(slot)
            pytest.fail(f"remove_request({slot}) of 3 slots: refuse a slot outside 0..2")
    assert batch.active_slots == [0, 2], "a refused add/remove must not change the slots"
    assert batch.remove_request(2) is first, "remove_request returns the cache the slot held"
    assert batch.active_slots == [0], "remove_request empties the slot"
    with pytest.raises(ValueError):
        batch.remove_request(2)  # already removed
    batch.add_request(first, 1)  # a freed slot, or another one, takes a request again
    assert batch.active_slots == [0, 1], "an emptied slot can be taken again"
    assert batch.slots[1] is first and batch.slots[0] is second, "each cache in its own slot"


def test_update_and_fetch_pads_and_masks_each_row(impl):
    rng = np.random.default_rng(0)
    lengths = {0: 3, 2: 7, 3: 5}  # slot -> tokens already cached; slot 1 stays empty
    batch = impl.BatchingKvCache(4)
    own = {}
    for slot in (3, 0, 2):  # the order of adding must not matter: rows follow slot order
        cache = impl.TinyKvFullCache()
        k, v = random_kv(rng, lengths[slot])
        cache.update_and_fetch(k, v)
        own[slot] = (cache, k, v)
        batch.add_request(cache, slot)
    assert batch.offset == [3, 7, 5]

    new_k = mx.array(rng.standard_normal((3, 2, 1, 8)).astype(np.float32))
    new_v = mx.array(rng.standard_normal((3, 2, 1, 8)).astype(np.float32))
    keys, values, mask = batch.update_and_fetch(new_k, new_v)
    assert keys.shape == (3, 2, 8, 8) and values.shape == (3, 2, 8, 8)
    assert mask.shape == (3, 1, 1, 8)
    assert batch.offset == [4, 8, 6]
    keys, values, mask = np.array(keys), np.array(values), np.array(mask)
    assert np.isfinite(keys).all() and np.isfinite(values).all(), "padding must be finite"

    for row, slot in enumerate([0, 2, 3]):
        cache, k, v = own[slot]
        n = lengths[slot] + 1
        assert cache.offset == n, f"row {row}: the new token goes into the slot's own cache"
        want_k = np.concatenate([np.array(k), np.array(new_k[row : row + 1])], axis=2)[0]
        want_v = np.concatenate([np.array(v), np.array(new_v[row : row + 1])], axis=2)[0]
        np.testing.assert_array_equal(keys[row, :, :n], want_k)
        np.testing.assert_array_equal(values[row, :, :n], want_v)
        visible = mask[row, 0, 0]
        assert (visible[:n] == 0).all(), f"row {row}: its own {n} positions must be visible"
        assert (visible[n:] < -1e4).all(), f"row {row}: padding after {n} must be masked"

    # Attention through the mask equals each row attending over only its own keys.
    q = mx.array(rng.standard_normal((3, 4, 1, 8)).astype(np.float32))
    out = impl.scaled_dot_product_attention_grouped(
        q, mx.array(keys), mx.array(values), mask=mx.array(mask)
    )
    for row, slot in enumerate([0, 2, 3]):
        n = lengths[slot] + 1
        alone = impl.scaled_dot_product_attention_grouped(
            q[row : row + 1],
            mx.array(keys[row : row + 1, :, :n]),
            mx.array(values[row : row + 1, :, :n]),
        )
        np.testing.assert_allclose(np.array(out[row : row + 1]), np.array(alone), atol=1e-5)

    # After a removal the rows are the remaining slots, still in slot order.
    batch.remove_request(2)
    keys, _, mask = batch.update_and_fetch(new_k[:2], new_v[:2])
    assert batch.offset == [5, 7]
    assert keys.shape == (2, 2, 7, 8) and mask.shape == (2, 1, 1, 7)
    np.testing.assert_array_equal(np.array(mask[0, 0, 0]) == 0, np.arange(7) < 5)
    assert (np.array(mask[1, 0, 0]) == 0).all()


def test_model_with_per_row_offsets_equals_each_row_alone(impl, model, tokenizer):
    # RoPE takes one offset per row: each row is rotated from its own start position.
    rng = np.random.default_rng(1)
    rope = impl.RoPE(32, 64)
    x = mx.array(rng.standard_normal((3, 2, 4, 32)).astype(np.float32))
    starts = [5, 0, 17]
    rotated = rope(x, starts)
    for row, start in enumerate(starts):
        np.testing.assert_allclose(
            np.array(rotated[row : row + 1]), np.array(rope(x[row : row + 1], start)), atol=1e-6
        )

    # The model with a BatchingKvCache per layer and a list of offsets: row b's logits equal
    # request b decoding alone on its own cache.
    prompts = [tokenizer.encode(p) for p in ("Hello", "The quick brown fox jumps over", "xyz")]
    slots = [0, 2, 3]
    batch_cache = [impl.BatchingKvCache(4) for _ in range(model.num_hidden_layers)]
    alone_caches, tokens = [], []
    for ids, slot in zip(prompts, slots):
        for_batch, alone = model.create_kv_cache(), model.create_kv_cache()
        logits = model(mx.array([ids]), 0, for_batch)
        model(mx.array([ids]), 0, alone)
        for layer_cache, request_cache in zip(batch_cache, for_batch):
            layer_cache.add_request(request_cache, slot)
        alone_caches.append(alone)
        tokens.append(mx.argmax(logits[0, -1]).item())

    offsets = [len(ids) for ids in prompts]
    rows = [0, 1, 2]
    for step in range(4):
        if step == 2:  # the middle request leaves; the others go on without it
            for layer_cache in batch_cache:
                layer_cache.remove_request(slots[1])
            rows = [0, 2]
        assert batch_cache[0].offset == [offsets[r] for r in rows], (
            "BatchingKvCache.offset: each active request's token count, in slot order"
        )
        batched = model(
            mx.array([[tokens[r]] for r in rows]), [offsets[r] for r in rows], batch_cache
        )  # [B, 1, V]
        assert batched.shape[:2] == (len(rows), 1), "one row of logits per active request"
        for b, r in enumerate(rows):
            single = model(mx.array([[tokens[r]]]), offsets[r], alone_caches[r])
            np.testing.assert_allclose(
                np.array(batched[b]),
                np.array(single[0]),
                atol=1e-4,
                err_msg=f"decode step {step}, request {r}",
            )
            tokens[r] = mx.argmax(single[0, -1]).item()
            offsets[r] += 1


# --- Tasks 3-4: Request ------------------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_request_prefill_then_decode_alone(impl, model, tokenizer, oracle, paged):
    prompt = PROMPTS[1]
    expected = oracle(prompt)
    pools = model.create_kv_pools(page_size=4) if paged else None
    request = impl.Request(
        model,
        tokenizer,
        prompt,
        WHOLE_PROMPT,
        prompt_idx=7,
        max_seq_len=MAX_SEQ_LEN,
        pools=pools,
    )
    n = len(request.prompt_tokens)
    assert not request.is_prefill_done and request.offset == 0, "a new request has run nothing"
    request.try_prefill()
    assert request.is_prefill_done, "a prompt shorter than prefill_max_step: one call prefills it"
    assert not request.is_done, "one token is far from every limit: the request goes on"
    assert request.offset == n, "after prefill the whole prompt is in the cache"
    assert request.generated == expected[:1], "prefill yields the first generated token"
    while not request.is_done:
        assert request.offset == request.kv_cache[0].offset, "offset: the tokens in the cache"
        logits = model(mx.array([[request.generated[-1]]]), request.offset, request.kv_cache)
        request.decode_done(mx.argmax(logits[0, -1]).item())
        assert request.offset == n + len(request.generated) - 1, (
            "decode_done: the previous token is now cached (offset + 1); the new one is not yet"
        )
    assert request.generated == expected, "the tokens of the request decoding alone"
    assert n + len(request.generated) == MAX_SEQ_LEN, "done when prompt + generated = max_seq_len"
    assert request.text() == tokenizer.decode(expected), "text(): the detokenized tokens"
    request.release()
    if paged:
        assert_all_pages_free(pools, "Request.release() must release every layer's pages")


# --- Task 5: batch_generate ------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_batched_equals_single_request(
    impl, model, tokenizer, oracle, monkeypatch, paged, batch_size
):
    expected = {i: oracle(p) for i, p in enumerate(PROMPTS)}
    pools = model.create_kv_pools(page_size=4) if paged else None
    tracker = CacheTracker(monkeypatch, model)
    log = StepLog()
    out = impl.batch_generate(
        model,
        tokenizer,
        PROMPTS,
        max_seq_len=MAX_SEQ_LEN,
        batch_size=batch_size,
        prefill_step=WHOLE_PROMPT,
        pools=pools,
        on_step=log,
    )
    assert [i for i, _ in out] == list(range(len(PROMPTS)))
    for i, text in out:
        assert text == tokenizer.decode(expected[i]), f"prompt {i}: {PROMPTS[i]!r}"
    assert log.finished == expected, "the tokens of a finished request (BatchStep.request)"
    assert log.max_occupancy() == batch_size, "the slots should all be busy at some point"
    tracker.assert_all_released()
    if paged:
        assert_pools_used(pools)
        assert_all_pages_free(pools, "every finished request must release its caches")


def test_slots_are_refilled_as_requests_finish(impl, model, tokenizer, oracle):
    prompts = PROMPTS[:7]  # more prompts than slots
    proxy = ModelSpy(model)
    log = StepLog()
    out = impl.batch_generate(
        proxy,
        tokenizer,
        prompts,
        max_seq_len=MAX_SEQ_LEN,
        batch_size=2,
        prefill_step=WHOLE_PROMPT,
        on_step=log,
    )
    assert out == [(i, tokenizer.decode(oracle(p))) for i, p in enumerate(prompts)]
    assert log.max_occupancy() == 2, "both slots should be busy at some point"
    assert max(proxy.decode_batch_sizes) == 2, "a decode step should batch both slots"
    assert min(proxy.decode_batch_sizes) >= 1, "never call the model with an empty batch"
    # Continuous, not static: a new prompt is prefilled while a request that was already
    # decoding when another one finished is still in its slot.
    seen_at_finish = []
    refilled = False
    for kind, request, occupants in log.steps:
        if kind == "finish":
            seen_at_finish += [r for r in occupants if r is not request]
        elif kind == "prefill" and any(r is s for r in occupants for s in seen_at_finish):
            refilled = True
    assert refilled, "a freed slot must be refilled while the other slot keeps decoding"
    # One batched forward pass per decode step, not one call per decoded token.
    decoded = sum(len(oracle(p)) - 1 for p in prompts)  # the first token comes from prefill
    assert sum(proxy.decode_batch_sizes) == decoded, "one decoded row per generated token"
    assert proxy.count("decode") < decoded, "decode steps must batch rows, not run one by one"


def test_prefill_events_count_the_rows_of_each_chunk(impl, model, tokenizer):
    """Prompts prefilled 4 tokens at a time: each "prefill" event carries the rows its chunk
    ran, so a prompt's events add up to its length."""
    log = StepLog()
    impl.batch_generate(
        model, tokenizer, PROMPTS[:3], max_seq_len=MAX_SEQ_LEN, batch_size=2, prefill_step=4,
        on_step=log,
    )  # fmt: skip
    prefilled, prompt_lengths = defaultdict(int), {}
    for step in log.events:
        if step.kind == "prefill":
            prefilled[step.request.prompt_idx] += step.tokens
            prompt_lengths[step.request.prompt_idx] = len(step.request.prompt_tokens)
    assert max(prompt_lengths.values()) > 8, "a prompt of several chunks (test setup)"
    assert dict(prefilled) == prompt_lengths, (
        f"prefill events count {dict(prefilled)} rows per prompt, the prompts hold "
        f"{prompt_lengths} tokens: report the rows each chunk ran (request.offset - before)"
    )


def test_eos_on_the_first_token_finishes_without_decoding(impl, model, tokenizer, oracle):
    first = oracle("Hello")[0]
    eos = set(tokenizer.eos_token_ids) | {first}
    proxy_tokenizer = TokenizerSpy(tokenizer, eos_token_ids=eos)

    # Alone: exactly one model call (the prefill), no decode step, no empty batch.
    proxy = ModelSpy(model)
    log = StepLog()
    out = impl.batch_generate(
        proxy,
        proxy_tokenizer,
        ["Hello"],
        max_seq_len=MAX_SEQ_LEN,
        batch_size=2,
        prefill_step=WHOLE_PROMPT,
        on_step=log,
    )
    assert out == [(0, tokenizer.decode([first]))]
    assert log.finished == {0: [first]}, "the request finishes with its first token, EOS"
    assert (proxy.count("prefill"), proxy.count("decode")) == (1, 0), (
        "a request done after prefill takes no slot, so there is nothing to decode"
    )
    assert "decode" not in log.kinds(), "no decode step may run with every slot empty"

    # Among other prompts: it never takes a slot, the others are unaffected.
    prompts = ["How are you today?", "Hello", "xyz", "def add(a, b):\n    return a + b"]
    log = StepLog()
    out = impl.batch_generate(
        model,
        proxy_tokenizer,
        prompts,
        max_seq_len=MAX_SEQ_LEN,
        batch_size=2,
        prefill_step=WHOLE_PROMPT,
        on_step=log,
    )
    assert out == [(i, tokenizer.decode(oracle(p, eos=eos))) for i, p in enumerate(prompts)]
    assert out[1] == (1, tokenizer.decode([first]))
    hello = [r for kind, r, _ in log.steps if kind == "prefill" and r.prompt_idx == 1]
    assert len(hello) == 1, "the prompt is prefilled once"
    for kind, _, occupants in log.steps:
        assert not any(r is hello[0] for r in occupants), f"it sat in a slot at a {kind} step"


def test_max_seq_len_bounds_prompt_plus_generated(impl, model, tokenizer, oracle):
    max_seq_len = 12
    lengths = [3, 10, 11, 12]  # a prompt may fill max_seq_len; it still gets its first token
    prompts = [prompt_with_tokens(tokenizer, n) for n in lengths]
    log = StepLog()
    out = impl.batch_generate(
        model,
        tokenizer,
        prompts,
        max_seq_len=max_seq_len,
        batch_size=3,
        prefill_step=WHOLE_PROMPT,
        on_step=log,
    )
    assert [i for i, _ in out] == [0, 1, 2, 3]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        count = max(1, max_seq_len - n)  # stop once prompt + generated reaches max_seq_len
        want = oracle(prompt, max_seq_len=n + count)
        assert log.finished[i] == want, f"prompt of {n} tokens"
        assert out[i][1] == tokenizer.decode(want), f"the text of the prompt of {n} tokens"
        if want[-1] not in tokenizer.eos_token_ids:
            assert len(want) == count, f"prompt of {n} tokens: stop at max_seq_len"


def test_prompts_as_token_ids_equal_their_text(impl, model, tokenizer, oracle):
    as_text = impl.batch_generate(model, tokenizer, PROMPTS, MAX_SEQ_LEN, 3, WHOLE_PROMPT)
    as_ids = [tokenizer.encode(p) for p in PROMPTS]
    mixed = [ids if i % 2 else text for i, (ids, text) in enumerate(zip(as_ids, PROMPTS))]
    for prompts in (as_ids, mixed):
        out = impl.batch_generate(model, tokenizer, prompts, MAX_SEQ_LEN, 3, WHOLE_PROMPT)
        assert out == as_text, "a prompt given as token ids must generate what its text does"


def test_max_new_tokens_and_ignore_eos(impl, model, tokenizer, oracle):
    """Budgets are honoured exactly (one for all, or one per prompt); ignore_eos decodes
    straight past EOS (with early_eos, "1, 2, 3" meets EOS at its second token)."""
    prompts, tok = ["1, 2, 3", "Hello", "xyz"], early_eos(tokenizer)
    log = StepLog()
    impl.batch_generate(
        model, tok, prompts, MAX_SEQ_LEN, 2, WHOLE_PROMPT, on_step=log, max_new_tokens=3
    )
    for i, p in enumerate(prompts):
        want = oracle(p, eos=tok.eos_token_ids)[:3]
        assert log.finished[i] == want, f"max_new_tokens=3, prompt {p!r}"
    log = StepLog()
    out = impl.batch_generate(
        model, tok, prompts, MAX_SEQ_LEN, 2, WHOLE_PROMPT, on_step=log,
        max_new_tokens=[8, 1, 2], ignore_eos=True,
    )  # fmt: skip
    for i, (p, budget) in enumerate(zip(prompts, [8, 1, 2])):
        want = oracle(p, eos=set())[:budget]
        assert log.finished[i] == want, f"prompt {p!r}: {budget} tokens, EOS ignored"
        assert out[i] == (i, tokenizer.decode(want))
    assert any(t in tok.eos_token_ids for t in log.finished[0][:-1]), (
        "the test expects EOS inside the first prompt's 8 tokens"
    )


def early_eos(tokenizer):
    """The tokenizer, with token 82 an EOS too: "1, 2, 3" then meets EOS at its second token."""
    return TokenizerSpy(tokenizer, eos_token_ids=set(tokenizer.eos_token_ids) | {82})


class StandInModel:
    """Just enough of a model for a Request that never runs it."""

    def __init__(self, vocab_size):
        self.config = type("Config", (), {"vocab_size": vocab_size})()

    def create_kv_cache(self):
        return []


def test_accept_records_tokens_and_stops_at_each_limit(impl, tokenizer):
    stand_in = StandInModel(tokenizer.vocab_size)
    eos = min(tokenizer.eos_token_ids)
    request = impl.Request(stand_in, tokenizer, [1, 2, 3])
    request.accept(5)
    assert request.generated == [5] and not request.is_done, "an ordinary token goes on"
    request.accept(eos)
    assert request.generated == [5, eos] and request.is_done, "EOS ends the request"

    request = impl.Request(stand_in, tokenizer, [1, 2, 3], ignore_eos=True, max_new_tokens=3)
    request.accept(eos)
    assert not request.is_done, "with ignore_eos, EOS is an ordinary token"
    request.accept(5)
    assert not request.is_done, "2 of max_new_tokens=3 generated: not done yet"
    request.accept(6)
    assert request.is_done, "max_new_tokens=3: done at the third generated token"

    request = impl.Request(stand_in, tokenizer, [1, 2, 3], max_seq_len=5)
    request.accept(5)
    assert not request.is_done, "3 prompt + 1 generated tokens: below max_seq_len=5"
    request.accept(6)
    assert request.is_done, "3 prompt + 2 generated tokens reach max_seq_len=5"


class ByteTokenizer:
    """A byte-level vocabulary: ids 0-255 are single bytes, and id 256 is a space followed by the
    first two bytes of an emoji (" \\xf0\\x9f"), a token of the kind byte-level BPE vocabularies
    learn. Its text ends inside a character, so the streaming detokenizer holds back the whole
    token, the complete space with it, until later bytes or finalize() decide it."""

    SPACE_AND_HALF_EMOJI = 256
    eos_token_ids = frozenset({0})
    vocab_size = 257

    def decode(self, ids, skip_special_tokens=False):
        pieces = [bytes([i]) if i < 256 else b" \xf0\x9f" for i in ids]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def encode(self, text):
        return list(text.encode("utf-8"))

    def detokenizer(self):
        return StreamingDetokenizer(self)


def test_accept_finalizes_text_that_ends_inside_a_character(impl):
    """A request cut off inside a multi-byte character: its text must be the detokenizer's
    finalized text (the held-back text flushed, the incomplete character dropped), not the
    streamed prefix. The last token carries a space before the incomplete character, so a
    request that never calls finalize() loses the space."""
    tokenizer = ByteTokenizer()
    tokens = [ord("h"), ord("i"), ByteTokenizer.SPACE_AND_HALF_EMOJI]
    stand_in = StandInModel(tokenizer.vocab_size)
    request = impl.Request(stand_in, tokenizer, [1], max_new_tokens=len(tokens))
    for token in tokens:
        request.accept(token)
    assert request.is_done, f"max_new_tokens={len(tokens)}: done"
    assert request.text() == "hi ", (
        f"the request's text is {request.text()!r}, expected 'hi ': it ended with a token "
        "whose text is a space and half a character, which the streaming detokenizer holds "
        "back; accept must call the detokenizer's finalize() when the request is done (it "
        "flushes the space and drops the incomplete character)"
    )


def test_decode_step_gives_every_slot_one_token(impl, model, tokenizer, oracle):
    prompts, tok = ["Hello", "1, 2, 3", "xyz"], early_eos(tokenizer)
    requests = [
        impl.Request(model, tok, p, WHOLE_PROMPT, i, MAX_SEQ_LEN) for i, p in enumerate(prompts)
    ]
    slots = [requests[0], None, requests[1], requests[2]]
    batch_cache = [impl.BatchingKvCache(4) for _ in range(model.num_hidden_layers)]
    for slot, request in enumerate(slots):
        if request is not None:
            request.try_prefill()
            for layer_cache, request_cache in zip(batch_cache, request.kv_cache):
                layer_cache.add_request(request_cache, slot)
    finished = []
    try:
        for step in range(5):
            impl.decode_step(model, slots, batch_cache, finished.append)
            for request, prompt in zip(requests, prompts):
                want = oracle(prompt, eos=tok.eos_token_ids)[: step + 2]
                assert request.generated == want, f"decode step {step}, prompt {prompt!r}"
        assert finished == [requests[1]], "the request that met EOS is handed to finish"
        assert slots == [requests[0], None, None, requests[2]], "its slot is freed"
        assert batch_cache[0].active_slots == [0, 3], "and its cache leaves the batch"
    finally:
        for layer_cache in batch_cache:
            layer_cache.release()


# --- limits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "limits",
    [{"batch_size": 0}, {"batch_size": -2}, {"max_seq_len": 0}, {"prefill_step": 0}],
    ids=["batch_size=0", "batch_size<0", "max_seq_len=0", "prefill_step=0"],
)
def test_bad_limits_raise_before_any_cache(impl, model, tokenizer, monkeypatch, limits):
    pools = model.create_kv_pools(page_size=4)
    tracker = CacheTracker(monkeypatch, model)
    kwargs = {"max_seq_len": MAX_SEQ_LEN, "batch_size": 2, "prefill_step": WHOLE_PROMPT}
    with pytest.raises(ValueError):
        impl.batch_generate(model, tokenizer, PROMPTS[:3], pools=pools, **{**kwargs, **limits})
    assert tracker.created == [], "bad limits must be refused before any request cache exists"
    assert_nothing_allocated(pools, "bad limits must be refused before any page is taken")


@pytest.mark.parametrize(
    "bad", ["too long", "empty", "empty ids", "id outside the vocabulary", "budget 0", "budgets"]
)
def test_bad_prompt_raises_before_any_cache(impl, model, tokenizer, monkeypatch, bad):
    # The bad prompt comes after good ones: checking lazily, at admission, is too late.
    last = {
        "too long": prompt_with_tokens(tokenizer, MAX_SEQ_LEN + 1),
        "empty": "",
        "empty ids": [],
        "id outside the vocabulary": [1, tokenizer.vocab_size + 5],
    }.get(bad, "How are you?")
    budget = {"budget 0": 0, "budgets": [4, 4]}.get(bad)  # "budgets": 2 limits for 3 prompts
    pools = model.create_kv_pools(page_size=4)
    tracker = CacheTracker(monkeypatch, model)
    with pytest.raises(ValueError):
        impl.batch_generate(
            model,
            tokenizer,
            ["Hello", "xyz", last],
            max_seq_len=MAX_SEQ_LEN,
            batch_size=2,
            prefill_step=WHOLE_PROMPT,
            pools=pools,
            max_new_tokens=budget,
        )
    assert tracker.created == [], "no request cache may exist when the input is refused"
    assert_nothing_allocated(pools, "check every prompt before the first one is admitted")


def test_no_prompts_returns_empty_list(impl, model, tokenizer, monkeypatch):
    tracker = CacheTracker(monkeypatch, model)
    proxy = ModelSpy(model)
    assert impl.batch_generate(proxy, tokenizer, [], max_seq_len=MAX_SEQ_LEN) == []
    assert tracker.created == [] and proxy.calls == [], "no prompts: no cache, no model call"


# --- faults ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        ("model", "prefill", 3),
        ("model", "decode", 5),
        ("add_token", None, 1),
        ("add_token", None, 6),
    ],
    ids=["prefill", "decode", "detokenize-at-prefill", "detokenize-at-decode"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_fault_propagates_and_releases_everything(
    impl, model, tokenizer, monkeypatch, fault, paged
):
    where, kind, n = fault
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "xyz", "How are you?"]
    pools = model.create_kv_pools(page_size=4) if paged else None
    tracker = CacheTracker(monkeypatch, model)
    proxy = ModelSpy(model, fail_after=nth_call_of(kind, n)) if where == "model" else model
    tok = TokenizerSpy(tokenizer, fail_add_at=n if where == "add_token" else None)
    log = StepLog()
    with pytest.raises(Injected):
        impl.batch_generate(
            proxy,
            tok,
            prompts,
            max_seq_len=MAX_SEQ_LEN,
            batch_size=2,
            prefill_step=WHOLE_PROMPT,
            pools=pools,
            on_step=log,
        )
    assert tracker.created, "the fault should hit after some request caches exist"
    tracker.assert_all_released()
    if paged:
        assert_pools_used(pools)
        assert_all_pages_free(pools, "after a fault the finally block must release every cache")


def test_events_count_rows_and_number_the_passes(impl, model, tokenizer):
    """Every prefill event gives the rows its chunk ran and every decode event its decode rows;
    forward_pass counts the model calls (1, 2, 3, ...), so a view or a benchmark can tell which
    events one pass produced."""
    spy = ModelSpy(model)
    log = StepLog()
    prompts = PROMPTS[:5]
    impl.batch_generate(
        spy, tokenizer, prompts, max_seq_len=24, batch_size=2, prefill_step=WHOLE_PROMPT,
        on_step=log,
    )  # fmt: skip
    work = [e for e in log.events if e.kind in ("prefill", "decode")]
    assert [e.forward_pass for e in work] == list(range(1, len(spy.calls) + 1)), (
        "each model call is one forward pass: BatchStep.forward_pass must count them 1, 2, 3, "
        "... and a prefill or decode event carries the number of the call that did its work"
    )
    for event, call in zip(work, spy.calls):
        rows = call.shape[0] if event.kind == "decode" else call.shape[1]
        assert event.tokens == rows, (
            f"a {event.kind} event reports tokens={event.tokens}, but its model call ran {rows} "
            "rows: tokens is the chunk's length for prefill, the number of decode rows for decode"
        )

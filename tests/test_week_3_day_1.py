"""Week 3 Day 1: continuous batching.

BatchingKvCache (Tasks 1-2), Request.try_prefill / decode_done (Tasks 3-4) and batch_generate
(Task 5). The oracle is Week 2's single-request greedy decoder: batching must not change a
single token. Prompts are prefilled whole here (prefill_step far above any prompt length);
chunked prefill is Week 3 Day 2.
"""

import mlx.core as mx
import numpy as np
import pytest

MAX_SEQ_LEN = 40
WHOLE_PROMPT = 512  # prefill_step larger than every prompt: one prefill call per prompt

PROMPTS = [
    "Hello",  # 4 tokens
    "The quick brown fox jumps over the lazy dog.",  # 16
    "a",  # 1
    "How are you today?",  # 6
    "1, 2, 3",  # 5; greedy decoding meets <|im_end|> after 5 tokens
    "def add(a, b):\n    return a + b",  # 15
    "naïve café 😀",  # 16, multi-byte characters
    "xyz",  # 3
]


class Boom(Exception):
    """The injected fault. Not a RuntimeError: NotImplementedError is one, Boom must not be."""


# --- helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(impl, tiny_gqa_ckpt):
    return impl.Qwen3Model(tiny_gqa_ckpt)


@pytest.fixture(scope="module")
def tokenizer(tiny_gqa_ckpt):
    return tiny_gqa_ckpt.tokenizer


@pytest.fixture(scope="module")
def oracle(impl, model, tokenizer):
    """oracle(prompt, max_seq_len, eos) -> the tokens one request alone generates greedily.

    Greedy decoding is deterministic, so a lower max_seq_len or more EOS ids only cut the
    same token sequence shorter: each prompt is decoded once, up to MAX_SEQ_LEN."""
    memo = {}

    def tokens_for(prompt, max_seq_len=MAX_SEQ_LEN, eos=None):
        ids = tokenizer.encode(prompt)
        assert max_seq_len <= MAX_SEQ_LEN
        if prompt not in memo:
            memo[prompt] = list(
                impl.simple_generate_with_kv_cache(
                    model, ids, MAX_SEQ_LEN - len(ids), eos_token_ids=tokenizer.eos_token_ids
                )
            )
        tokens = memo[prompt][: max_seq_len - len(ids)]
        stops = [i for i, t in enumerate(tokens) if t in (eos or tokenizer.eos_token_ids)]
        return tokens[: stops[0] + 1] if stops else tokens

    return tokens_for


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
    """An on_step callback that keeps what each step showed (slots copied at that moment)."""

    def __init__(self):
        self.steps = []  # (kind, request, [requests in slots])
        self.finished = {}  # prompt_idx -> generated tokens

    def __call__(self, step):
        occupants = [r for r in step.slots if r is not None]
        self.steps.append((step.kind, step.request, occupants))
        if step.kind == "finish":
            self.finished[step.request.prompt_idx] = list(step.request.generated)

    def kinds(self):
        return [kind for kind, _, _ in self.steps]

    def max_occupancy(self):
        return max((len(occupants) for _, _, occupants in self.steps), default=0)


class ModelProxy:
    """Forwards to the model, counts prefill calls (a whole prompt at offset 0) and decode
    calls (one token per row), and can raise Boom right after the n-th call of one kind has
    run (so its caches were already written)."""

    def __init__(self, model, fail_kind=None, fail_at=None):
        self.model, self.fail_kind, self.fail_at = model, fail_kind, fail_at
        self.calls = {"prefill": 0, "decode": 0}
        self.decode_batch_sizes = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, *args, **kwargs):
        out = self.model(tokens, *args, **kwargs)
        offset = args[0] if args else kwargs["offset"]
        kind = "decode" if tokens.shape[1] == 1 and offset != 0 else "prefill"
        self.calls[kind] += 1
        if kind == "decode":
            self.decode_batch_sizes.append(tokens.shape[0])
        if kind == self.fail_kind and self.calls[kind] == self.fail_at:
            raise Boom(f"injected fault in {kind} call {self.fail_at}")
        return out


class TokenizerProxy:
    """Forwards to the tokenizer; may replace eos_token_ids, and may make the n-th
    detokenizer add_token call (over all requests) raise Boom."""

    def __init__(self, tokenizer, eos_token_ids=None, fail_add_at=None):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(
            tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids
        )
        self.fail_add_at = fail_add_at
        self.adds = 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def detokenizer(self):
        detok = self.tokenizer.detokenizer()
        add_token = detok.add_token

        def counted_add_token(token):
            self.adds += 1
            if self.adds == self.fail_add_at:
                raise Boom(f"injected fault in add_token call {self.adds}")
            return add_token(token)

        detok.add_token = counted_add_token
        return detok


def prompt_with_tokens(tokenizer, n):
    """A prompt that encodes to exactly n tokens."""
    base = "The quick brown fox jumps over the lazy dog. " * 4
    for end in range(1, len(base) + 1):
        if len(tokenizer.encode(base[:end])) == n:
            return base[:end]
    raise AssertionError(f"no prefix of the base text has {n} tokens")


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
    assert batch.active_slots == [0, 2]
    with pytest.raises(ValueError):
        batch.add_request(impl.TinyKvFullCache(), 2)  # taken
    with pytest.raises(ValueError):
        batch.add_request(impl.TinyKvFullCache(), 3)  # no such slot
    with pytest.raises(ValueError):
        batch.remove_request(1)  # empty
    assert batch.active_slots == [0, 2], "a refused add/remove must not change the slots"
    assert batch.remove_request(2) is first
    assert batch.active_slots == [0]
    with pytest.raises(ValueError):
        batch.remove_request(2)  # already removed
    batch.add_request(first, 1)  # a freed slot, or another one, takes a request again
    assert batch.active_slots == [0, 1]
    assert batch.slots[1] is first and batch.slots[0] is second


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
        assert batch_cache[0].offset == [offsets[r] for r in rows]
        batched = model(
            mx.array([[tokens[r]] for r in rows]), [offsets[r] for r in rows], batch_cache
        )  # [B, 1, V]
        assert batched.shape[:2] == (len(rows), 1)
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
    assert not request.is_prefill_done and request.offset == 0
    request.try_prefill()
    assert request.is_prefill_done and not request.is_done
    assert request.offset == n, "after prefill the whole prompt is in the cache"
    assert request.generated == expected[:1], "prefill yields the first generated token"
    while not request.is_done:
        assert request.offset == request.kv_cache[0].offset
        logits = model(mx.array([[request.generated[-1]]]), request.offset, request.kv_cache)
        request.decode_done(mx.argmax(logits[0, -1]).item())
        assert request.offset == n + len(request.generated) - 1
    assert request.generated == expected
    assert n + len(request.generated) == MAX_SEQ_LEN
    assert request.text() == tokenizer.decode(expected)
    request.release()
    if paged:
        assert all(pool.num_in_use == 0 for pool in pools)


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
        assert all(pool.num_allocations > 0 for pool in pools), "the pools were not used"
        assert all(pool.num_in_use == 0 for pool in pools), "pages left in use"


def test_slots_are_refilled_as_requests_finish(impl, model, tokenizer, oracle):
    prompts = PROMPTS[:7]  # more prompts than slots
    proxy = ModelProxy(model)
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
    assert log.max_occupancy() == 2
    assert max(proxy.decode_batch_sizes) == 2 and min(proxy.decode_batch_sizes) >= 1
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
    assert sum(proxy.decode_batch_sizes) == decoded
    assert proxy.calls["decode"] < decoded


def test_eos_on_the_first_token_finishes_without_decoding(impl, model, tokenizer, oracle):
    first = oracle("Hello")[0]
    eos = set(tokenizer.eos_token_ids) | {first}
    proxy_tokenizer = TokenizerProxy(tokenizer, eos_token_ids=eos)

    # Alone: exactly one model call (the prefill), no decode step, no empty batch.
    proxy = ModelProxy(model)
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
    assert log.finished == {0: [first]}
    assert proxy.calls == {"prefill": 1, "decode": 0}
    assert "decode" not in log.kinds()

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
    assert len(hello) == 1
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
        assert out[i][1] == tokenizer.decode(want)
        if want[-1] not in tokenizer.eos_token_ids:
            assert len(want) == count


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
    assert tracker.created == []
    assert all(pool.num_allocations == 0 for pool in pools)


@pytest.mark.parametrize("bad", ["too long", "empty"])
def test_bad_prompt_raises_before_any_cache(impl, model, tokenizer, monkeypatch, bad):
    # The bad prompt comes after good ones: checking lazily, at admission, is too late.
    long_prompt = prompt_with_tokens(tokenizer, MAX_SEQ_LEN + 1)
    prompts = ["Hello", "xyz", long_prompt if bad == "too long" else ""]
    pools = model.create_kv_pools(page_size=4)
    tracker = CacheTracker(monkeypatch, model)
    with pytest.raises(ValueError):
        impl.batch_generate(
            model,
            tokenizer,
            prompts,
            max_seq_len=MAX_SEQ_LEN,
            batch_size=2,
            prefill_step=WHOLE_PROMPT,
            pools=pools,
        )
    assert tracker.created == [], "no request cache may exist when the input is refused"
    assert all(pool.num_allocations == 0 for pool in pools)


def test_no_prompts_returns_empty_list(impl, model, tokenizer, monkeypatch):
    tracker = CacheTracker(monkeypatch, model)
    proxy = ModelProxy(model)
    assert impl.batch_generate(proxy, tokenizer, [], max_seq_len=MAX_SEQ_LEN) == []
    assert tracker.created == [] and proxy.calls == {"prefill": 0, "decode": 0}


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
    proxy = ModelProxy(model, fail_kind=kind, fail_at=n) if where == "model" else model
    tok = TokenizerProxy(tokenizer, fail_add_at=n if where == "add_token" else None)
    log = StepLog()
    with pytest.raises(Boom):
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
        assert all(pool.num_allocations > 0 for pool in pools)
        assert all(pool.num_in_use == 0 for pool in pools), "pages left in use after a fault"

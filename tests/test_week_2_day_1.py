"""Week 2 Day 1: the dense KV cache, the model with an offset, cached generation.

The oracle for the model is a full recompute: the Week 1 model (no cache) run on the whole
sequence so far. Cached decoding must give the same logits at every step. mlx-lm's Qwen3 with
its own KV cache serves as a second, independent oracle.
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_bad_prompts_refused
from mlx_lm.models.cache import make_prompt_cache
from oracles import mlx_lm_model

ATOL = RTOL = 1e-4
DECODE_STEPS = 32
PROMPT = "Keys and values, cached once."


def assert_close(actual: mx.array, expected: mx.array, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(
        np.array(actual), np.array(expected), atol=ATOL, rtol=RTOL, err_msg=what
    )


def prompt_tokens(ckpt) -> list[int]:
    tokens = ckpt.tokenizer.encode(PROMPT)
    assert len(tokens) > 1
    return tokens


def random_kv(shape, seed):
    rng = np.random.RandomState(seed)
    k = mx.array(rng.standard_normal(shape).astype(np.float32))
    v = mx.array(rng.standard_normal(shape).astype(np.float32))
    return k, v


# --- Task 1: the dense cache ---------------------------------------------------------------


def test_full_cache_appends_and_returns_everything(impl):
    cache = impl.TinyKvFullCache()
    assert cache.offset == 0, "a new cache holds nothing"
    b, h, d = 2, 3, 4
    all_k, all_v = [], []
    for i, length in enumerate([5, 1, 1, 3]):
        k, v = random_kv((b, h, length, d), seed=i)
        all_k.append(k)
        all_v.append(v)
        keys, values, mask = cache.update_and_fetch(k, v)
        s = sum(x.shape[2] for x in all_k)
        assert cache.offset == s, "the offset advances by exactly the rows appended"
        assert mask is None, "a dense cache has no mask of its own"
        assert_close(keys, mx.concatenate(all_k, axis=2), "keys: every row so far, in order")
        assert_close(values, mx.concatenate(all_v, axis=2), "values: every row so far, in order")


def test_full_cache_rejects_mismatched_rows(impl):
    cache = impl.TinyKvFullCache()
    k, v = random_kv((1, 2, 3, 4), seed=0)
    cache.update_and_fetch(k, v)
    bad_value = mx.zeros((1, 2, 3, 5))
    with pytest.raises(ValueError):
        cache.update_and_fetch(k, bad_value)  # key and value differ
    for shape in [(1, 3, 1, 4), (1, 2, 1, 5), (2, 2, 1, 4)]:  # heads, head_dim, batch
        with pytest.raises(ValueError):
            cache.update_and_fetch(mx.zeros(shape), mx.zeros(shape))
    assert cache.offset == 3, "a rejected append changes nothing"
    keys, values, _ = cache.update_and_fetch(*random_kv((1, 2, 1, 4), seed=1))
    assert keys.shape == values.shape == (1, 2, 4, 4), "3 cached rows + 1: return all 4"
    assert_close(keys[:, :, :3], k, "the rows cached before the rejected appends")
    cache.release()
    assert cache.offset == 0, "release() empties the cache"
    keys, _, _ = cache.update_and_fetch(*random_kv((1, 2, 2, 4), seed=2))
    assert keys.shape == (1, 2, 2, 4), "after release the cache starts empty"


# --- Task 2: attention with a cache --------------------------------------------------------


def test_attention_with_cache_matches_week1_attention(impl, tiny_ckpt):
    """Prefill 6 rows, then feed 5 rows one at a time: each output row equals the same row
    of Week 1 attention run over all 11 rows at once."""
    c = tiny_ckpt.config
    cached_attn = impl.Qwen3Model(tiny_ckpt).layers[0].self_attn
    full_attn = impl.Qwen3ModelWeek1(tiny_ckpt).layers[0].self_attn
    x = mx.array(np.random.RandomState(0).standard_normal((1, 11, c.hidden_size)), mx.float32)
    cache = impl.TinyKvFullCache()
    outputs = [cached_attn(x[:, :6], 0, cache)]
    assert cache.offset == 6, "attention appends its 6 new keys/values to the cache"
    for i in range(6, 11):
        outputs.append(cached_attn(x[:, i : i + 1], i, cache))
        assert cache.offset == i + 1, "one decode row appends one key/value"
    assert_close(mx.concatenate(outputs, axis=1), full_attn(x), "attention with a cache")


def test_attend_appends_then_attends_over_the_whole_cache(impl, tiny_gqa_ckpt):
    """attend alone, against mx.fast.scaled_dot_product_attention: 3 rows on an empty cache
    (square causal mask), then one decode row on top (it sees the 3 cached rows and itself).
    Several rows over a non-empty cache need Week 3 Day 2's rectangular mask."""
    c = tiny_gqa_ckpt.config
    attention = impl.Qwen3Model(tiny_gqa_ckpt).layers[0].self_attn
    h, h_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q1, q2 = random_kv((1, h, 3, d), 5)[0], random_kv((1, h, 1, d), 6)[0]
    k1, v1 = random_kv((1, h_kv, 3, d), 7)
    k2, v2 = random_kv((1, h_kv, 1, d), 8)
    cache = impl.TinyKvFullCache()
    scale = d**-0.5

    def causal(L, S):  # [L, S], query i at absolute position S - L + i
        blocked = np.arange(S)[None, :] > (S - L + np.arange(L))[:, None]
        return mx.array(np.where(blocked, -np.inf, 0.0).astype(np.float32))

    first = attention.attend(q1, k1, v1, cache, None)
    want = mx.fast.scaled_dot_product_attention(q1, k1, v1, scale=scale, mask=causal(3, 3))
    assert_close(first, want, "3 rows on an empty cache")
    second = attention.attend(q2, k2, v2, cache, None)
    keys, values = mx.concatenate([k1, k2], axis=2), mx.concatenate([v1, v2], axis=2)
    want = mx.fast.scaled_dot_product_attention(q2, keys, values, scale=scale, mask=causal(1, 4))
    assert_close(second, want, "1 row over 3 cached ones: it must see the cache too")
    assert cache.offset == 4, "attend appends the new keys/values to the cache"


def test_attend_uses_the_mask_the_cache_returns(impl, tiny_gqa_ckpt):
    """A cache may return a mask of its own from update_and_fetch (Week 3's batching cache masks
    each row's padding that way); attend must use it instead of the model's."""
    c = tiny_gqa_ckpt.config
    attention = impl.Qwen3Model(tiny_gqa_ckpt).layers[0].self_attn
    h, h_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hide_first = mx.array([[-np.inf, 0.0, 0.0, 0.0]])  # [1, S=4]: key 0 is padding

    class MaskingCache(impl.TinyKvFullCache):
        def update_and_fetch(self, key, value):
            keys, values, _ = super().update_and_fetch(key, value)
            return keys, values, hide_first[:, : keys.shape[2]]

    cache = MaskingCache()
    k1, v1 = random_kv((1, h_kv, 3, d), 7)
    cache.update_and_fetch(k1, v1)
    q = random_kv((1, h, 1, d), 6)[0]
    k2, v2 = random_kv((1, h_kv, 1, d), 8)
    got = attention.attend(q, k2, v2, cache, None)
    keys, values = mx.concatenate([k1, k2], axis=2), mx.concatenate([v1, v2], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=d**-0.5, mask=hide_first)
    assert_close(got, want, "the cache returned a mask (key 0 hidden): attend must use it")


# --- Task 3: the model forward pass --------------------------------------------------------


def test_cached_decoding_matches_full_recompute(impl, tiny_ckpt):
    """Prefill the prompt, then decode greedily for 32 steps feeding one token per step.

    At every step the logits must equal the Week 1 model's last row over the whole sequence.
    This is also the test for RoPE positions: a decode token rotated at offset - 1 or
    offset + 1 (an off-by-one) changes its keys and queries, and the logits drift away from
    the full recompute from the first decode step on.
    """
    model, oracle = impl.Qwen3Model(tiny_ckpt), impl.Qwen3ModelWeek1(tiny_ckpt)
    cache = model.create_kv_cache()
    tokens = prompt_tokens(tiny_ckpt)
    logits = model(mx.array([tokens]), 0, cache)  # [1, P, V]
    assert_close(logits, oracle(mx.array([tokens])), "prefill logits")
    for step in range(DECODE_STEPS):
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), len(tokens) - 1, cache)  # [1, 1, V]
        assert logits.shape == (1, 1, tiny_ckpt.config.vocab_size)
        expected = oracle(mx.array([tokens]))[:, -1:, :]
        assert_close(logits, expected, f"decode step {step}")


def test_offsets_advance_by_rows_appended(impl, tiny_ckpt):
    c = tiny_ckpt.config
    model = impl.Qwen3Model(tiny_ckpt)
    cache = model.create_kv_cache()
    assert len(cache) == c.num_hidden_layers == model.num_hidden_layers, "one cache per layer"
    tokens = prompt_tokens(tiny_ckpt)
    model(mx.array([tokens]), 0, cache)
    expected = len(tokens)
    kv_shape = (1, c.num_key_value_heads, 1, c.head_dim)
    for step in range(4):
        for layer_cache in cache:
            assert layer_cache.offset == expected, f"after {step} decode steps"
        model(mx.array([[tokens[step]]]), expected, cache)
        expected += 1
    # whatever the storage (concatenated arrays or preallocated buffers), the cache returns
    # exactly `offset` rows
    keys, values, _ = cache[0].update_and_fetch(mx.zeros(kv_shape), mx.zeros(kv_shape))
    assert keys.shape == values.shape == (1, c.num_key_value_heads, expected + 1, c.head_dim), (
        "update_and_fetch returns exactly the cached rows (the first offset positions), not the "
        "whole preallocated buffer"
    )


def test_logits_to_keep_returns_the_tail(impl, tiny_ckpt):
    """Two rows of the same length in one batch; logits_to_keep keeps only the last rows."""
    model, oracle = impl.Qwen3Model(tiny_ckpt), impl.Qwen3ModelWeek1(tiny_ckpt)
    rows = mx.array(np.random.RandomState(3).randint(0, 600, (2, 9)), mx.int32)
    full = model(rows, 0, model.create_kv_cache())
    assert_close(full, oracle(rows), "batched prefill logits")
    for keep in (1, 3, 9):
        cache = model.create_kv_cache()
        kept = model(rows, 0, cache, logits_to_keep=keep)
        assert kept.shape == (2, keep, tiny_ckpt.config.vocab_size), "[B, logits_to_keep, V]"
        assert_close(kept, full[:, -keep:, :], f"logits_to_keep={keep}")
        assert cache[0].offset == 9, "every row is cached, whatever logits are kept"
    # the next token after a logits_to_keep=1 prefill still sees the whole prompt
    step = model(rows[:, :1], 9, cache, logits_to_keep=1)
    expected = oracle(mx.concatenate([rows, rows[:, :1]], axis=1))[:, -1:, :]
    assert_close(step, expected, "decode after logits_to_keep prefill")


def test_model_rejects_offset_that_does_not_match_cache(impl, tiny_gqa_ckpt):
    model = impl.Qwen3Model(tiny_gqa_ckpt)
    cache = model.create_kv_cache()
    with pytest.raises(ValueError):
        model(mx.array([[1, 2, 3]]), 2, cache)  # an empty cache starts at offset 0
    assert cache[0].offset == 0, "a rejected call appends nothing: check before the layers run"
    model(mx.array([[1, 2, 3, 4, 5]]), 0, cache)
    for wrong in (0, 4, 6):
        with pytest.raises(ValueError):
            model(mx.array([[7]]), wrong, cache)
    assert all(layer_cache.offset == 5 for layer_cache in cache), "a rejected call changes nothing"
    with pytest.raises(ValueError):
        model(mx.array([[7]]), 5, cache[:-1])  # one cache per layer
    assert model(mx.array([[7]]), 5, cache).shape == (1, 1, tiny_gqa_ckpt.config.vocab_size)


def test_matches_mlx_lm_with_its_own_cache(impl, tiny_ckpt):
    """mlx-lm's Qwen3, decoding with its own KV cache, step by step (an independent oracle)."""
    model = impl.Qwen3Model(tiny_ckpt)
    cache = model.create_kv_cache()
    tokens = prompt_tokens(tiny_ckpt)
    logits = model(mx.array([tokens]), 0, cache)
    reference = mlx_lm_model(tiny_ckpt)
    reference_cache = make_prompt_cache(reference)
    assert_close(logits, reference(mx.array([tokens]), cache=reference_cache), "prefill")
    for step in range(DECODE_STEPS):
        token = mx.argmax(logits[:, -1, :], axis=-1)[:, None]  # [1, 1]
        logits = model(token, len(tokens) + step, cache)
        expected = reference(token, cache=reference_cache)
        assert_close(logits, expected, f"decode step {step}")


# --- Task 4: generation with a cache -------------------------------------------------------


class SpyModel:
    """Forwards to a Qwen3Model and records what the generation loop asks of it."""

    def __init__(self, model):
        self.model = model
        self.num_hidden_layers = model.num_hidden_layers
        self.calls: list[tuple[tuple[int, ...], int]] = []
        self.kept: list[int | None] = []  # logits_to_keep of each call
        self.caches: list[list] = []

    def create_kv_cache(self):
        cache = self.model.create_kv_cache()
        self.caches.append(cache)
        return cache

    def __call__(self, tokens, offset, cache, logits_to_keep=None):
        self.calls.append((tuple(tokens.shape), offset))
        self.kept.append(logits_to_keep)
        return self.model(tokens, offset, cache, logits_to_keep=logits_to_keep)


def test_generate_with_kv_cache_matches_simple_generate(impl, tiny_ckpt):
    tokens = prompt_tokens(tiny_ckpt)
    spy = SpyModel(impl.Qwen3Model(tiny_ckpt))
    cached = list(impl.simple_generate_with_kv_cache(spy, tokens, max_tokens=DECODE_STEPS))
    plain = list(impl.simple_generate(impl.Qwen3ModelWeek1(tiny_ckpt), tokens, DECODE_STEPS))
    assert len(cached) == DECODE_STEPS, "max_tokens tokens, no EOS among them"
    assert cached == plain, "the cached loop must pick the tokens the Week 1 loop picks"
    assert all(isinstance(t, int) for t in cached), "yield Python ints (.item())"
    p = len(tokens)
    assert spy.calls[0] == ((1, p), 0), "the first call is the whole prompt at offset 0"
    assert spy.calls[1:] == [((1, 1), p + i) for i in range(DECODE_STEPS - 1)], (
        "every later call feeds only the newest token at its position"
    )
    assert set(spy.kept) == {1}, (
        f"logits_to_keep of each call: {sorted(set(spy.kept), key=str)}; pass logits_to_keep=1: "
        "the loop samples from the last row only, and without it the prompt's call computes the "
        "output head for every prompt position"
    )
    assert len(spy.caches) == 1, "one set of caches per generation (create_kv_cache once)"
    assert all(layer_cache.offset == 0 for layer_cache in spy.caches[0]), (
        "the caches are released when generation ends"
    )


def test_generate_with_kv_cache_stops_at_eos(impl, tiny_gqa_ckpt):
    tokens = prompt_tokens(tiny_gqa_ckpt)
    spy = SpyModel(impl.Qwen3Model(tiny_gqa_ckpt))
    full = list(impl.simple_generate_with_kv_cache(spy, tokens, max_tokens=12))
    eos = full[5]
    stopped = list(impl.simple_generate_with_kv_cache(spy, tokens, 12, eos_token_ids={eos}))
    assert stopped == full[: full.index(eos) + 1], "the EOS token is yielded, then generation stops"
    assert all(layer_cache.offset == 0 for layer_cache in spy.caches[-1]), (
        "the caches are released when generation stops at EOS (try / finally)"
    )
    assert list(impl.simple_generate_with_kv_cache(spy, tokens, max_tokens=0)) == [], (
        "max_tokens=0 yields nothing"
    )
    assert_bad_prompts_refused(impl.simple_generate_with_kv_cache, spy, tokens)

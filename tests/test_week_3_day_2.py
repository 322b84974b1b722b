"""Week 3 Day 2: chunked prefill.

Task 1  Request.try_prefill runs one slice of at most prefill_max_step prompt tokens per call.
Task 2  causal_mask(L, S) is the rectangular mask with diagonal offset S - L; the model uses it
        (through qwen3.attention_mask) when a chunk of L > 1 tokens lands on a non-empty cache,
        and scaled_dot_product_attention_grouped for mask="causal" with L < S.
Task 3  materialize() hooks: the dense cache evaluates its own key/value arrays, the paged cache
        evaluates its pages where they lie, the batching cache delegates.

Everything runs the tiny GQA checkpoint on the CPU in float32.
"""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    Call,
    Injected,
    ModelSpy,
    TokenizerSpy,
    assert_all_pages_free,
    assert_pools_used,
    prompt_with_tokens,
    release_all,
)


def make_cache(model, kind: str):
    """'dense' or 'paged-<page size>': a fresh per-layer cache (and its pools, if any)."""
    if kind == "dense":
        return model.create_kv_cache(), None
    pools = model.create_kv_pools(page_size=int(kind.split("-")[1]))
    return model.create_paged_kv_cache(pools), pools


def flatten(args) -> list:
    """The arrays in mx.eval's arguments, whatever lists/tuples they were wrapped in."""
    out = []
    for a in args:
        if isinstance(a, list | tuple):
            out += flatten(a)
        else:
            out.append(a)
    return out


# --- Task 1: Request.try_prefill -------------------------------------------------------------


@pytest.mark.parametrize(
    "length",
    [3, 4, 5, 11, 12],
    ids=[
        "shorter-than-a-chunk",
        "one-chunk",
        "one-token-more",
        "three-chunks",
        "three-exact-chunks",
    ],
)
def test_try_prefill_runs_one_chunk_per_call(impl, model, tokenizer, length):
    step = 4
    prompt = prompt_with_tokens(tokenizer, length)
    spy = ModelSpy(model)
    request = impl.Request(spy, tokenizer, prompt, prefill_max_step=step)
    ids = request.prompt_tokens
    assert len(ids) == length, "the test's prompt has the intended length"
    starts = list(range(0, length, step))
    assert request.num_prefill_chunks == len(starts)

    for k, start in enumerate(starts):
        assert not request.is_prefill_done, f"prefill done before chunk {k} of {len(starts)}"
        assert request.generated == [], "a token was accepted before the last chunk"
        request.try_prefill()
        width = min(step, length - start)
        assert len(spy.calls) == k + 1, "one model call per try_prefill"
        call = spy.calls[-1]
        assert call.shape == (1, width), f"chunk {k}: width"
        assert call.offset == start, f"chunk {k}: the absolute offset of the slice"
        assert call.tokens == [ids[start : start + width]], f"chunk {k}: the prompt slice"
        assert call.cache is request.kv_cache, "the model must get the request's own caches"
        assert request.offset == start + width, f"chunk {k}: offset advances by its width"
        assert request.is_prefill_done == (k == len(starts) - 1), (
            f"chunk {k} of {len(starts)}: is_prefill_done only after the last chunk"
        )

    assert request.offset == length, "after the last chunk the whole prompt is cached"
    # The first token comes from the last chunk's logits, which match a one-shot prefill.
    one_shot = model(mx.array([ids]), 0, model.create_kv_cache())
    assert request.generated == [mx.argmax(one_shot[0, -1]).item()], (
        "the first token is the argmax of the last chunk's last logits row (if only the "
        "cases of several chunks fail here, the chunk's logits are wrong: check causal_mask and "
        "RoPE's offset, as test_chunked_prefill_equals_one_shot_prefill says)"
    )

    with pytest.raises(ValueError):
        request.try_prefill()
    assert len(spy.calls) == len(starts), "a refused try_prefill must not run the model"
    assert request.offset == length, "a refused try_prefill must not move the offset"
    request.release()


# --- Task 2: the rectangular causal mask -----------------------------------------------------


def test_causal_mask_three_by_eight(impl):
    # A five-token prefix in the cache, a three-token chunk: query row i sits at position 5 + i.
    ninf = -np.inf
    expected = np.array(
        [
            [0, 0, 0, 0, 0, 0, ninf, ninf],
            [0, 0, 0, 0, 0, 0, 0, ninf],
            [0, 0, 0, 0, 0, 0, 0, 0],
        ],
        dtype=np.float32,
    )
    mask = impl.causal_mask(3, 8, mx.float32)
    assert mask.shape == (3, 8)
    assert mask.dtype == mx.float32, "causal_mask's dtype argument defaults to float32"
    np.testing.assert_array_equal(np.array(mask), expected)
    # The model picks this mask for a chunk that lands after cached tokens.
    np.testing.assert_array_equal(np.array(impl.attention_mask(3, 8, mx.float32)), expected)


def test_causal_mask_is_the_bottom_of_the_square_mask(impl):
    rng = np.random.default_rng(0)
    pairs = [(1, 1), (1, 6), (4, 4), (5, 6)]
    pairs += [tuple(sorted(rng.integers(1, 24, size=2).tolist())) for _ in range(8)]
    for L, S in pairs:
        square = np.triu(np.full((S, S), -np.inf, dtype=np.float32), k=1)
        np.testing.assert_array_equal(np.array(impl.causal_mask(S, S, mx.float32)), square)
        mask = impl.causal_mask(L, S, mx.float32)
        assert mask.shape == (L, S)
        np.testing.assert_array_equal(np.array(mask), square[S - L :], err_msg=f"L={L} S={S}")
        if L > 1:  # what the model uses for a chunk of L tokens over S - L cached ones
            model_mask = impl.attention_mask(L, S, mx.float32)
            if not isinstance(model_mask, str):  # "causal" is allowed when L == S
                np.testing.assert_array_equal(np.array(model_mask), square[S - L :])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_causal_mask_keeps_the_dtype(impl, dtype):
    mask = impl.causal_mask(2, 5, dtype)
    assert mask.dtype == dtype, "the mask has the dtype it was asked for"
    expected = np.triu(np.full((5, 5), -np.inf, dtype=np.float32), k=1)[3:]
    np.testing.assert_array_equal(np.array(mask.astype(mx.float32)), expected)


@pytest.mark.parametrize("L, S", [(5, 4), (2, 1), (0, 3), (-1, 3)])
def test_causal_mask_rejects_impossible_shapes(impl, L, S):
    # L > S would put a query before the first key; L < 1 is no query at all.
    with pytest.raises(ValueError):
        impl.causal_mask(L, S, mx.float32)


@pytest.mark.parametrize("h_q, h_kv, L, S", [(4, 2, 3, 8), (4, 4, 1, 5), (6, 2, 5, 6)])
def test_causal_string_is_the_rectangle_for_fewer_queries_than_keys(impl, h_q, h_kv, L, S):
    # mask="causal" with L < S: the L queries are the last L of the S keys (bottom-right),
    # exactly as MLX's fused attention reads it.
    kq, kk, kv = mx.random.split(mx.random.key(L * S), 3)
    q = mx.random.normal((2, h_q, L, 16), key=kq)
    k, v = (mx.random.normal((2, h_kv, S, 16), key=key) for key in (kk, kv))
    got = impl.scaled_dot_product_attention_grouped(q, k, v, mask="causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=16**-0.5, mask="causal")
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    half = [a.astype(mx.float16) for a in (q, k, v)]
    got = impl.scaled_dot_product_attention_grouped(*half, mask="causal")
    assert got.dtype == mx.float16, (
        f"float16 queries gave {got.dtype} output: build the rectangle with causal_mask(L, S, "
        "query.dtype), so that a float32 mask does not promote the scores"
    )


# --- Tasks 1 + 2: chunking is exact --------------------------------------------------------
#
# Why a RoPE offset that is off by one breaks this test: RoPE rotates q and k by their absolute
# positions, and a score q_i . k_j depends only on the distance i - j. Prefilling in one shot
# places token t at position t. If a chunk starting at offset s > 0 were rotated as if it began
# at s + 1 (or at 0), its queries and keys would be shifted against the keys already in the
# cache, every distance across the chunk boundary would be wrong, and the logits would no
# longer match the one-shot run. Checked against the reference with the attention layer's RoPE
# call patched to offset + 1 whenever offset > 0 (the model's own offset check does not see
# that): every chunk size below the prompt length fails here, by 4 to 8 logit units against an
# atol of 1e-4. A shift applied to every position alike would go unnoticed (only distances
# count), which is why the chunks start at many different offsets, and why the whole-prompt
# case cannot catch it: there, both runs are equally wrong.

CHUNK_PROMPT_TOKENS = 29  # prime: every chunk size below leaves a ragged last chunk
DECODE_STEPS = 4


@pytest.mark.parametrize("kind", ["dense", "paged-1", "paged-4"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 16, CHUNK_PROMPT_TOKENS])
def test_chunked_prefill_logits_equal_one_shot(model, tokenizer, kind, chunk):
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, CHUNK_PROMPT_TOKENS))

    one_shot_cache = model.create_kv_cache()
    expected = model(mx.array([ids]), 0, one_shot_cache)  # [1, T, V]

    cache, pools = make_cache(model, kind)
    pieces = []
    for start in range(0, len(ids), chunk):
        pieces.append(model(mx.array([ids[start : start + chunk]]), start, cache))
    chunked = mx.concatenate(pieces, axis=1)
    assert chunked.shape == expected.shape, "one logits row per prompt token"
    np.testing.assert_allclose(
        np.array(chunked),
        np.array(expected),
        rtol=1e-4,
        atol=1e-4,
        err_msg=f"chunks of {chunk}: check causal_mask's diagonal (S - L) and RoPE's offset",
    )

    # The caches must agree too: the decode steps that read them give the same logits.
    token, offset = mx.argmax(expected[0, -1]).item(), len(ids)
    for step in range(DECODE_STEPS):
        want = model(mx.array([[token]]), offset, one_shot_cache)
        got = model(mx.array([[token]]), offset, cache)
        np.testing.assert_allclose(
            np.array(got), np.array(want), rtol=1e-4, atol=1e-4, err_msg=f"decode step {step}"
        )
        token, offset = mx.argmax(want[0, -1]).item(), offset + 1
    release_all(cache)
    release_all(one_shot_cache)
    if pools is not None:
        assert_all_pages_free(pools, "release() on every layer")


def test_later_chunks_are_rotated_at_their_absolute_positions(impl, model, tokenizer, monkeypatch):
    """The classic chunking bug, isolated: RoPE must see positions start..start+L-1 for the
    chunk that starts at `start`, not 0..L-1. Every RoPE call made by each try_prefill is
    recorded (one int offset, one per row, or an array of positions)."""
    rope_type = type(model.layers[0].self_attn.rope)
    rotate, seen = rope_type.__call__, []

    def spy(self, x, offset=0):
        b, l = x.shape[:2]
        if isinstance(offset, mx.array):
            seen.append(np.array(offset).reshape(b, l)[0].tolist())
        else:
            first = offset if isinstance(offset, int) else offset[0]
            seen.append(list(range(first, first + l)))
        return rotate(self, x, offset)

    monkeypatch.setattr(rope_type, "__call__", spy)
    request = impl.Request(model, tokenizer, prompt_with_tokens(tokenizer, 10), prefill_max_step=4)
    try:
        for start in (0, 4, 8):
            seen.clear()
            request.try_prefill()
            want = list(range(start, min(start + 4, 10)))
            assert seen, "try_prefill ran no RoPE through the model's layers"
            for positions in seen:
                assert positions == want, (
                    f"the chunk of prompt tokens {want[0]}..{want[-1]} was rotated at positions "
                    f"{positions[0]}..{positions[-1]}: a later chunk's RoPE positions must start "
                    f"at its absolute offset ({start}, the tokens already in the cache), not at 0"
                )
    finally:
        request.release()


# --- Task 3: materialize hooks -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "paged-4"])
def test_try_prefill_materializes_every_layer_after_every_chunk(impl, model, tokenizer, kind):
    step, length = 4, 11  # chunks of 4, 4, 3
    pools = None if kind == "dense" else model.create_kv_pools(page_size=4)
    request = impl.Request(
        model, tokenizer, prompt_with_tokens(tokenizer, length), prefill_max_step=step, pools=pools
    )
    seen: list[list[int]] = [[] for _ in request.kv_cache]  # cache offset at each materialize()

    for layer, layer_cache in enumerate(request.kv_cache):
        original = layer_cache.materialize

        def spy(layer=layer, layer_cache=layer_cache, original=original):
            seen[layer].append(layer_cache.offset)
            return original()

        layer_cache.materialize = spy

    for k in range(request.num_prefill_chunks):
        request.try_prefill()
        done = min(step * (k + 1), length)
        for layer in range(model.num_hidden_layers):
            # Once per chunk, after the chunk's keys/values were appended.
            assert seen[layer] == [min(step * (j + 1), length) for j in range(k + 1)], (
                f"layer {layer} after chunk {k} (the cache holds {done} tokens): the list is the "
                "cache's offset at each materialize() call ([] means it was never called on this "
                "layer); try_prefill calls it on every layer after the chunk ran"
            )
    assert request.is_prefill_done, "the prompt is in after its last chunk"
    request.release()


def test_dense_materialize_evaluates_its_own_arrays(impl, monkeypatch):
    cache = impl.TinyKvFullCache()
    for n in (3, 2):
        k = mx.random.normal((1, 2, n, 8))
        cache.update_and_fetch(k, k * 2)
    evaluated = []
    real_eval = mx.eval

    def eval_spy(*args):
        evaluated.extend(flatten(args))
        return real_eval(*args)

    monkeypatch.setattr(mx, "eval", eval_spy)
    cache.materialize()
    monkeypatch.undo()

    assert len(evaluated) == 2, "evaluate exactly the cached keys and values"
    assert any(a is cache.keys for a in evaluated), "the cache's own keys array"
    assert any(a is cache.values for a in evaluated), "the cache's own values array"
    assert cache.offset == 5, "materialize changes nothing in the cache"


def test_paged_materialize_evaluates_its_pages_without_gathering(impl, monkeypatch):
    pool = impl.TinyKvPagedPool(num_kv_heads=2, head_dim=8, page_size=4)
    mine, other = impl.TinyKvPagedCache(pool), impl.TinyKvPagedCache(pool)
    # Interleave two requests so this cache's page table is not simply 0, 1, 2.
    for cache, n in [(mine, 5), (other, 3), (other, 4), (mine, 6)]:
        kv = mx.random.normal((1, 2, n, 8))
        cache.update_and_fetch(kv, -kv)
    assert mine.page_table != list(range(len(mine.page_table))), "the test needs scattered pages"
    want = pool.storage  # the pool's storage arrays themselves: key_pages and value_pages

    evaluated = []
    real_eval = mx.eval

    def eval_spy(*args):
        evaluated.extend(flatten(args))
        return real_eval(*args)

    def no_gather(*args, **kwargs):
        raise AssertionError("materialize must not gather the pages into a dense tensor")

    monkeypatch.setattr(mx, "eval", eval_spy)
    monkeypatch.setattr(mx, "concatenate", no_gather)
    monkeypatch.setattr(mx, "stack", no_gather)
    monkeypatch.setattr(pool, "gather", no_gather)
    mine.materialize()
    monkeypatch.undo()

    assert Counter(map(id, evaluated)) == Counter(map(id, want)), (
        "evaluate exactly the pool's storage arrays, self.pool.storage (key_pages and "
        "value_pages: the pages live in them; a slice or a row of them would be a new array, "
        "and evaluating it computes the whole array anyway)"
    )
    assert mine.offset == 11 and pool.num_in_use == 5, "materialize changes no page or offset"
    mine.release()
    other.release()
    assert_all_pages_free([pool], "release() of both caches")


def test_batching_cache_materialize_delegates_to_active_requests(impl):
    batch = impl.BatchingKvCache(max_active_requests=3)
    caches = [impl.TinyKvFullCache() for _ in range(3)]
    counts = [0, 0, 0]
    for i, cache in enumerate(caches):

        def spy(i=i):
            counts[i] += 1

        cache.materialize = spy

    batch.add_request(caches[0], 0)
    batch.add_request(caches[1], 2)
    batch.materialize()
    assert counts == [1, 1, 0], (
        f"materialize() calls per request cache {counts}: slots 0 and 2 are active, slot 1 empty: "
        "call materialize() on the cache of every active slot, once"
    )
    batch.remove_request(0)
    batch.add_request(caches[2], 1)
    batch.materialize()
    assert counts == [1, 2, 1], "only the requests still in a slot"


# --- batch_generate: chunking changes the schedule, never the text --------------------------

BATCH_PROMPT_TOKENS = [5, 30, 17]
BATCH_MAX_SEQ_LEN = 44


@pytest.fixture(scope="module")
def batch_prompts(tokenizer):
    return [prompt_with_tokens(tokenizer, n) for n in BATCH_PROMPT_TOKENS]


@pytest.fixture(scope="module")
def single_request_texts(impl, model, tokenizer, batch_prompts):
    """Each prompt alone, greedy, through the Week 2 cached generation loop."""
    texts = []
    for prompt in batch_prompts:
        ids = tokenizer.encode(prompt)
        detokenizer = tokenizer.detokenizer()
        for token in impl.simple_generate_with_kv_cache(
            model,
            ids,
            max_tokens=BATCH_MAX_SEQ_LEN - len(ids),
            eos_token_ids=tokenizer.eos_token_ids,
        ):
            detokenizer.add_token(token)
        detokenizer.finalize()
        texts.append(detokenizer.text)
    return texts


@pytest.mark.parametrize("kind", ["dense", "paged-4"])
@pytest.mark.parametrize("prefill_step", [1, 3, 16, 512])
def test_batch_generate_text_does_not_depend_on_prefill_step(
    impl, model, tokenizer, batch_prompts, single_request_texts, kind, prefill_step
):
    pools = None if kind == "dense" else model.create_kv_pools(page_size=4)
    steps = []

    def on_step(step):
        active = any(r is not None for r in step.slots)
        offset = step.request.offset if step.request is not None else None
        steps.append((step.kind, step.request, offset, active))

    result = impl.batch_generate(
        model,
        tokenizer,
        batch_prompts,
        max_seq_len=BATCH_MAX_SEQ_LEN,
        batch_size=2,
        prefill_step=prefill_step,
        pools=pools,
        on_step=on_step,
    )
    # prefill_step=512 is the unchunked run; every run equals each prompt generated alone.
    assert result == list(enumerate(single_request_texts)), (
        f"prefill_step={prefill_step}: chunking must not change any text"
    )

    prefills = [(request, offset) for kind_, request, offset, _ in steps if kind_ == "prefill"]
    assert len(prefills) == sum(-(-n // prefill_step) for n in BATCH_PROMPT_TOKENS), (
        "one try_prefill call per chunk of every prompt"
    )
    done: dict[int, int] = {}
    for request, offset in prefills:
        grown = offset - done.get(id(request), 0)
        assert 1 <= grown <= prefill_step, "one scheduler iteration admits at most prefill_step"
        done[id(request)] = offset
    # The fairness policy: after a chunk, every active request decodes before the next chunk.
    for i, (kind_, _, _, active) in enumerate(steps):
        if kind_ == "prefill" and active:
            following = [k for k, *_ in steps[i + 1 :] if k != "finish"]
            assert following[:1] == ["decode"], f"step {i}: decodes must not wait for two chunks"
    if pools is not None:
        assert_all_pages_free(pools, "every finished request must release its pages")


# --- failures return every page ------------------------------------------------------------

FAIL_PROMPT_TOKENS = [6, 20, 12]


def is_later_prefill(call: Call) -> bool:
    return isinstance(call.offset, int) and call.offset > 0 and call.shape[1] > 1


def is_decode(call: Call) -> bool:
    return call.shape[1] == 1


@pytest.mark.parametrize("where", ["prefill", "materialize", "decode", "detokenize"])
def test_failure_anywhere_returns_every_page(impl, model, tokenizer, monkeypatch, where):
    pools = model.create_kv_pools(page_size=4)
    prompts = [prompt_with_tokens(tokenizer, n) for n in FAIL_PROMPT_TOKENS]
    in_use_at_failure: list[int] = []

    def note_failure() -> bool:
        in_use_at_failure.append(sum(pool.num_in_use for pool in pools))
        return True

    runner, tok = model, tokenizer
    if where == "prefill":  # the third chunk that lands on a non-empty cache
        runner = ModelSpy(
            model,
            fail_before=lambda calls: (
                is_later_prefill(calls[-1])
                and sum(map(is_later_prefill, calls)) == 3
                and note_failure()
            ),
        )
    elif where == "decode":
        runner = ModelSpy(
            model,
            fail_before=lambda calls: (
                is_decode(calls[-1]) and sum(map(is_decode, calls)) == 6 and note_failure()
            ),
        )
    elif where == "detokenize":
        tok = TokenizerSpy(tokenizer, fail_add_at=8, on_fail=note_failure)
    else:
        real = impl.TinyKvPagedCache.materialize
        calls = [0]

        def failing_materialize(self):
            calls[0] += 1
            if calls[0] == 7:  # chunk 4, layer 0
                note_failure()
                raise Injected("materialize")
            return real(self)

        monkeypatch.setattr(impl.TinyKvPagedCache, "materialize", failing_materialize)

    with pytest.raises(Injected):
        impl.batch_generate(
            runner, tok, prompts, max_seq_len=40, batch_size=2, prefill_step=4, pools=pools
        )
    assert in_use_at_failure and in_use_at_failure[0] > 0, "the failure hit a busy pool"
    assert_pools_used(pools)
    assert_all_pages_free(pools, f"after a failure in {where}, the finally block must release")

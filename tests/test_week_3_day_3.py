"""Week 3 Day 3: shape-stable prefill.

Task 1  prefill_query_width(rows, chunk_width, steps=3): the padding ladder.
Task 2  CompiledBlock.__call__: the block's token-parallel halves run compiled, with the
        positions passed in as an array (a new offset must not be a new trace).
Task 3  rewind(length) on the dense, paged and batching caches.
Task 4  Request.forward_chunk pads a chunk to a ladder width, keeps the last real row's logits
        and rewinds the cache past the padded rows.
Task 5  CompileCache: one mx.compile variant per input shape, least recently used evicted.

Oracles: exact arithmetic (padded == unpadded == one-shot logits, compiled == eager logits) and
counters: traces are counted inside the compiled function, never by timing.
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import ModelSpy, assert_close, prompt_with_tokens, release_all

PADDING_SWITCH = "TINY_LLM_PREFILL_QUERY_PADDING"


@pytest.fixture(autouse=True)
def _no_padding_switch(monkeypatch):
    monkeypatch.delenv(PADDING_SWITCH, raising=False)


# --- Task 1: the ladder ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, width",
    [(113, 171), (176, 342), (311, 342), (1, 171), (171, 171), (172, 342), (512, 512)],
)
def test_ladder_examples_from_the_seed(impl, rows, width):
    got = impl.prefill_query_width(rows, 512)
    assert got == width, (
        f"{rows} rows of a 512-wide chunk: got {got}, expected {width}. The widths are "
        "multiples of the step ceil(512 / 3) = 171, rounded up, not down, capped at 512"
    )


@pytest.mark.parametrize("chunk_width", [1, 2, 3, 4, 7, 128, 171, 512, 513, 1000])
@pytest.mark.parametrize("steps", [1, 3, 8])
def test_ladder_invariants(impl, chunk_width, steps):
    round_up = (
        "round the step size up (ceil(chunk_width / steps)): a step rounded down leaves a stray "
        "width between its last multiple and the chunk width, or is 0 for a chunk narrower "
        "than the steps"
    )
    try:
        widths = [
            impl.prefill_query_width(rows, chunk_width, steps) for rows in range(1, chunk_width + 1)
        ]
    except ZeroDivisionError as e:
        pytest.fail(f"chunk {chunk_width}, {steps} steps: {e!r}: {round_up}", pytrace=False)
    for rows, width in enumerate(widths, start=1):
        assert rows <= width <= chunk_width, f"{rows} rows padded to {width}"
    ladder = sorted(set(widths))
    assert len(ladder) <= steps, (
        f"chunk {chunk_width}, {steps} steps: {len(ladder)} widths {ladder}, more than {steps}: "
        f"{round_up}"
    )
    assert ladder[-1] == chunk_width, (
        f"the top of the ladder must be the chunk width itself, got {ladder}: round the step "
        "size up (ceil(chunk_width / steps)) so no stray width is left above the ladder"
    )
    step = -(-chunk_width // steps)
    assert ladder == sorted({min(k * step, chunk_width) for k in range(1, steps + 1)}), (
        f"chunk {chunk_width}, {steps} steps: widths must be multiples of {step}, capped at "
        f"the chunk width, got {ladder}"
    )


@pytest.mark.parametrize("rows, chunk, steps", [(0, 512, 3), (513, 512, 3), (5, 512, 0)])
def test_ladder_refuses_bad_input(impl, rows, chunk, steps):
    with pytest.raises(ValueError):
        impl.prefill_query_width(rows, chunk, steps)


# --- Task 5: the compile cache ---------------------------------------------------------------


def test_compile_cache_counts_and_evicts_least_recently_used(impl):
    w = mx.random.normal((16, 16), key=mx.random.key(0))
    fn = lambda x: mx.maximum(x @ w, 0.0)
    cache = impl.CompileCache(fn, capacity=4)
    script = [3, 4, 5, 3, 6, 7, 4, 3, 3, 8]
    # 3 4 5 compile; 3 hits; 6 compiles (4 kept); 7 compiles, evicts 4 (least recently used:
    # 3 was used after it); 4 compiles again, evicts 5; 3 hits twice; 8 compiles, evicts 6.
    for rows in script:
        x = mx.ones((rows, 16))
        assert_close(cache(x), fn(x), f"{rows} rows through the cache")
    counts = (cache.compiles, cache.hits, cache.evictions, cache.traces)
    assert counts == (7, 3, 3, 7), (
        "compiles, hits, evictions, traces for rows 3 4 5 3 6 7 4 3 3 8 at capacity 4: "
        f"expected (7, 3, 3, 7), got {counts}. A hit must move its variant to the most "
        "recently used end; an eviction drops the least recently used one"
    )
    kept = [key[0][0][0] for key in cache.variants]
    assert kept == [7, 4, 3, 8], f"variants kept, least recently used first: {kept}"


def test_compile_cache_traces_once_per_shape(impl):
    cache = impl.CompileCache(lambda x: x * 2.0 + 1.0, capacity=4)
    for _ in range(5):
        cache(mx.ones((2, 3)))
    assert cache.traces == 1, f"five calls of one shape traced {cache.traces} times"
    assert (cache.compiles, cache.hits) == (1, 4)
    with pytest.raises(ValueError):
        impl.CompileCache(lambda x: x, capacity=0)


# --- Task 2: compiled blocks, positions as arrays -------------------------------------------


def decode(model, ids, steps, cache):
    """Greedy logits [V] of the prompt's last token and of `steps` decode steps."""
    logits = [model(mx.array([ids]), 0, cache)[0, -1]]
    for step in range(steps):
        token = mx.argmax(logits[-1]).item()
        logits.append(model(mx.array([[token]]), len(ids) + step, cache)[0, -1])
    return logits


def test_compiled_model_equals_eager_and_traces_once_per_shape(
    impl, model, tiny_gqa_ckpt, tokenizer
):
    compiled = impl.Qwen3Model(tiny_gqa_ckpt, compiled=True)
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 7))
    eager_cache, compiled_cache = model.create_kv_cache(), compiled.create_kv_cache()
    want, got = decode(model, ids, 20, eager_cache), decode(compiled, ids, 20, compiled_cache)
    for step, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, f"compiled vs eager logits, step {step}", atol=1e-5, rtol=1e-5)
    layers = compiled.num_hidden_layers
    traces = compiled.compile_stats()["traces"]
    assert traces == 2 * 2 * layers, (
        f"a 7-token prefill and 20 decode steps traced {traces} times over {layers} layers; "
        f"expected {2 * 2 * layers} (two shapes x two compiled halves x layers). If it grows "
        "with the decode steps, the offset reaches the compiled code as a Python int, which "
        "mx.compile bakes into the trace: pass the positions in as an array"
    )
    release_all(eager_cache)
    release_all(compiled_cache)


def test_compiled_model_with_one_offset_per_row(impl, model, tiny_gqa_ckpt, tokenizer):
    compiled = impl.Qwen3Model(tiny_gqa_ckpt, compiled=True)
    prompts = [tokenizer.encode(p) for p in ("Hello", "The quick brown fox jumps over", "xyz")]
    results = []
    for m in (model, compiled):
        batch = [impl.BatchingKvCache(3) for _ in range(m.num_hidden_layers)]
        tokens, offsets = [], []
        for slot, ids in enumerate(prompts):
            cache = m.create_kv_cache()
            logits = m(mx.array([ids]), 0, cache)
            tokens.append([mx.argmax(logits[0, -1]).item()])
            offsets.append(len(ids))
            for layer_cache, request_cache in zip(batch, cache):
                layer_cache.add_request(request_cache, slot)
        results.append(m(mx.array(tokens), offsets, batch))
        release_all(batch)
    assert_close(results[1], results[0], "batched decode, one offset per row", atol=1e-5, rtol=1e-5)


# --- Task 3: rewind --------------------------------------------------------------------------


def random_kv(length, seed, heads=2, dim=8):
    rng = np.random.RandomState(seed)
    shape = (1, heads, length, dim)
    return (
        mx.array(rng.standard_normal(shape).astype(np.float32)),
        mx.array(rng.standard_normal(shape).astype(np.float32)),
    )


def test_dense_rewind_rolls_back_and_the_next_append_overwrites(impl):
    cache = impl.TinyKvFullCache()
    k1, v1 = random_kv(5, 0)
    cache.update_and_fetch(k1, v1)
    cache.rewind(3)
    assert cache.offset == 3, "rewind(3) leaves 3 tokens"
    k2, v2 = random_kv(2, 1)
    keys, values, _ = cache.update_and_fetch(k2, v2)
    assert_close(keys, mx.concatenate([k1[:, :, :3], k2], axis=2), "keys after rewind + append")
    assert_close(values, mx.concatenate([v1[:, :, :3], v2], axis=2), "values after rewind + append")


@pytest.mark.parametrize("length", [-1, 6])
def test_rewind_refuses_forward_or_negative(impl, length):
    for cache in (impl.TinyKvFullCache(), impl.TinyKvPagedCache(impl.TinyKvPagedPool(2, 8, 4))):
        cache.update_and_fetch(*random_kv(5, 0))
        with pytest.raises(ValueError):
            cache.rewind(length)
        assert cache.offset == 5, f"a refused rewind({length}) must change nothing"


def test_paged_rewind_returns_exactly_the_pages_past_the_end(impl):
    pool = impl.TinyKvPagedPool(2, 8, page_size=4)
    cache = impl.TinyKvPagedCache(pool)
    k, v = random_kv(11, 0)
    cache.update_and_fetch(k, v)  # 11 tokens: 3 pages
    assert pool.num_in_use == 3
    for length, pages in [(9, 3), (8, 2), (5, 2), (4, 1), (0, 0)]:
        cache.rewind(length)
        assert (cache.offset, len(cache.page_table), pool.num_in_use) == (length, pages, pages), (
            f"rewind({length}) with pages of 4 keeps ceil({length} / 4) = {pages} pages and "
            f"returns the rest to the pool; got offset {cache.offset}, "
            f"{len(cache.page_table)} pages in the table, {pool.num_in_use} in use"
        )
    keys, _, _ = cache.update_and_fetch(k[:, :, :6], v[:, :, :6])
    assert_close(keys, k[:, :, :6], "appending after a rewind to 0")
    cache.release()
    assert pool.num_in_use == 0


def test_batching_rewind_rolls_back_each_active_request(impl):
    batch = impl.BatchingKvCache(3)
    caches = [impl.TinyKvFullCache(), impl.TinyKvFullCache()]
    for cache, n, slot in zip(caches, (4, 6), (0, 2)):
        cache.update_and_fetch(*random_kv(n, n))
        batch.add_request(cache, slot)
    with pytest.raises(ValueError):
        batch.rewind([3])  # one length for two active requests
    with pytest.raises(ValueError):
        batch.rewind([3, 7])  # the second would go forward
    assert batch.offset == [4, 6], "a refused rewind changes no request"
    batch.rewind([2, 5])
    assert batch.offset == [2, 5]


# --- Task 4: padded prefill ------------------------------------------------------------------

PROMPT_TOKENS = 29


def prefill_logits(impl, model, tokenizer, chunk, padding, pools=None):
    """The logits [V] of the prompt's last token after prefill in chunks through
    Request.forward_chunk, checking the cache length after every chunk."""
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, PROMPT_TOKENS))
    request = impl.Request(
        model, tokenizer, ids, prefill_max_step=chunk, pools=pools, query_padding=padding
    )
    for start in range(0, len(ids), chunk):
        chunk_ids = ids[start : start + chunk]
        logits = request.forward_chunk(chunk_ids)
        end = start + len(chunk_ids)
        assert request.kv_cache[0].offset == end, (
            f"after the chunk at {start} the cache must hold {end} tokens, it holds "
            f"{request.kv_cache[0].offset}: rewind the cache past the padded rows"
        )
        request.offset = end
    request.release()
    return logits, ids


@pytest.mark.parametrize("kind", ["dense", "paged-4"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 16, PROMPT_TOKENS])
def test_padded_chunks_equal_unpadded_and_one_shot(impl, model, tokenizer, kind, chunk):
    spy = ModelSpy(model)
    pools = model.create_kv_pools(page_size=4) if kind == "paged-4" else None
    padded, ids = prefill_logits(impl, spy, tokenizer, chunk, padding=True, pools=pools)
    widths = {call.shape[1] for call in spy.calls}
    ladder = {impl.prefill_query_width(r, chunk) for r in range(1, chunk + 1)}
    assert widths <= ladder, (
        f"with padding every prefill call must be a ladder width {sorted(ladder)}, "
        f"saw {sorted(widths)}"
    )
    unpadded, _ = prefill_logits(impl, model, tokenizer, chunk, padding=False)
    one_shot = model(mx.array([ids]), 0, model.create_kv_cache())[0, -1]
    assert_close(padded, unpadded, f"padded vs unpadded, chunk {chunk}")
    assert_close(padded, one_shot, f"padded chunks vs one-shot prefill, chunk {chunk}")
    if pools is not None:
        assert all(pool.num_in_use == 0 for pool in pools), "pages left in use"


def test_padding_keeps_the_last_real_row_not_the_last_row(impl, model, tokenizer):
    """A 5-token chunk padded to 6 rows: the returned logits are row 4's, not row 5's (the
    padded copy of the last token sits one position later and gives other logits)."""
    spy = ModelSpy(model)
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 5))
    request = impl.Request(spy, tokenizer, ids, prefill_max_step=18, query_padding=True)
    logits = request.forward_chunk(ids)
    assert spy.calls[0].shape == (1, 6), "5 rows of an 18-wide chunk pad to the width 6"
    want = model(mx.array([ids]), 0, model.create_kv_cache())[0, -1]
    assert_close(logits, want, "the logits of the last real token (row 4 of 6)")
    request.release()


def generate(impl, model, tokenizer, prompts, **kwargs):
    return impl.batch_generate(
        model, tokenizer, prompts, max_seq_len=48, batch_size=2, prefill_step=8, **kwargs
    )


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_greedy_text_is_the_same_with_padding_on_and_off(impl, model, tokenizer, paged):
    prompts = [prompt_with_tokens(tokenizer, n) for n in (3, 9, 14, 22, 5)]
    pools = model.create_kv_pools(page_size=4) if paged else None
    off = generate(impl, model, tokenizer, prompts, pools=pools, query_padding=False)
    spy = ModelSpy(model)
    on = generate(impl, spy, tokenizer, prompts, pools=pools, query_padding=True)
    assert on == off, "query padding must not change a single generated token"
    prefill_widths = {call.shape[1] for call in spy.calls if call.kind == "prefill"}
    assert prefill_widths <= {3, 6, 8}, f"ladder of an 8-wide chunk is 3, 6, 8: {prefill_widths}"
    if pools is not None:
        assert all(pool.num_in_use == 0 for pool in pools)


def test_padding_defaults_to_the_compiled_model_and_the_switch_turns_it_off(
    impl, model, tiny_gqa_ckpt, tokenizer, monkeypatch
):
    compiled = impl.Qwen3Model(tiny_gqa_ckpt, compiled=True)
    ids = [1, 2, 3, 4, 5]
    assert impl.Request(model, tokenizer, ids).query_width is None, "eager: no padding"
    assert impl.Request(compiled, tokenizer, ids).query_width is impl.prefill_query_width, (
        "compiled: the three-step ladder by default"
    )
    monkeypatch.setenv(PADDING_SWITCH, "0")
    assert impl.Request(compiled, tokenizer, ids, query_padding=True).query_width is None, (
        f"{PADDING_SWITCH}=0 turns padding off everywhere"
    )


class RowDroppingModel(ModelSpy):
    """A decoder that contracts the query axis: it returns one row fewer than asked for."""

    def __call__(self, tokens, offset, cache, logits_to_keep=None):
        logits = super().__call__(tokens, offset, cache, logits_to_keep=logits_to_keep)
        return logits[:, 1:] if logits.shape[1] > 1 else logits


def test_a_model_that_drops_rows_switches_padding_off_and_reruns(impl, model, tokenizer):
    dropping = RowDroppingModel(model)
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, 5))
    request = impl.Request(dropping, tokenizer, ids, prefill_max_step=18, query_padding=True)
    logits = request.forward_chunk(ids)
    shapes = [call.shape for call in dropping.calls]
    assert shapes == [(1, 6), (1, 5)], (
        f"expected one padded call of 6 rows, then the chunk re-run unpadded: saw {shapes}"
    )
    assert request.kv_cache[0].offset == 5, "the re-run starts from a cache rewound to the offset"
    want = model(mx.array([ids]), 0, model.create_kv_cache())[0, -1]
    assert_close(logits, want, "logits of the re-run")
    again = impl.Request(dropping, tokenizer, ids, prefill_max_step=18, query_padding=True)
    again.forward_chunk(ids)
    shapes = [call.shape for call in dropping.calls[2:]]
    assert shapes == [(1, 5)], (
        f"the next request's chunk ran as {shapes}, expected one unpadded call [(1, 5)]: once "
        "a model has dropped rows, padding stays off for it. The fallback must set "
        "self.model.query_padding_ok = False"
    )
    request.release()
    again.release()


# --- everything together: a bounded set of compiled shapes ----------------------------------


def run_twice(impl, ckpt, tokenizer, padding):
    model = impl.Qwen3Model(ckpt, compiled=True, compile_capacity=4)
    prompts = [prompt_with_tokens(tokenizer, n) for n in range(5, 25)]  # 20 distinct lengths
    spy = ModelSpy(model)
    traces, outputs = [], []
    for _ in range(2):
        before = model.compile_stats()["traces"]
        outputs.append(
            impl.batch_generate(
                spy, tokenizer, prompts, max_seq_len=64, batch_size=1, prefill_step=24,
                max_new_tokens=3, query_padding=padding,
            )
        )  # fmt: skip
        traces.append(model.compile_stats()["traces"] - before)
    widths = {call.shape[1] for call in spy.calls if call.kind == "prefill"}
    return traces, widths, outputs, model.num_hidden_layers


def test_padding_bounds_the_compiled_shapes(impl, tiny_gqa_ckpt, tokenizer):
    traces, widths, outputs, layers = run_twice(impl, tiny_gqa_ckpt, tokenizer, padding=True)
    assert len(widths) <= 3, f"with padding at most 3 prefill widths, saw {sorted(widths)}"
    assert traces[1] == 0, (
        f"the second pass over the same 20 prompts traced {traces[1]} times: 3 prefill widths "
        "and the decode shape fit a capacity of 4, so nothing should be compiled again"
    )
    unpadded_traces, unpadded_widths, unpadded_outputs, _ = run_twice(
        impl, tiny_gqa_ckpt, tokenizer, padding=False
    )
    assert len(unpadded_widths) == 20, "without padding every prompt length is its own width"
    assert unpadded_traces[1] > 0, "without padding the second pass must compile again (cap 4)"
    assert outputs == unpadded_outputs, "padding must not change the generated text"
    assert traces[0] <= 4 * 2 * layers

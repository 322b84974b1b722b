"""Week 4 Day 7: long context.

Task 1  window_mask (sliding_window.py): the causal mask with a lower edge, W positions seen.
Task 2  windowed_attention: flash attention over the band, key blocks outside it skipped.
Task 3  TinyKvWindowedPagedCache.release_left_behind: pages that left the window go back.
Task 4  ring_prefill_attention (ring_attention.py): each rank's part, the blocks passed around
        the ring, the visible ones merged with the online softmax of Week 3 Day 5.
Task 5  merge_ranks: a decode step's partial results merged over the ranks.

Oracles: MLX's fused attention with an explicit banded mask, mlx-lm's Qwen3 layers run with
explicit banded masks (mlx-lm itself ignores the window), and the one-process model for the
ranks (two ranks under mlx.launch, tests/tp_ranks.py --checks ring).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tp_ranks
from helpers import assert_close, prompt_with_tokens, rank_check_problems

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint, mlx_lm_qwen3

W = 8  # the window of the synthetic checkpoint's sliding layers
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention"]
WINDOWED = dict(
    num_hidden_layers=3, use_sliding_window=True, sliding_window=W, layer_types=LAYER_TYPES
)


@pytest.fixture(scope="module")
def win_ckpt(tmp_path_factory):
    """Three layers: full attention, then two with a window of 8 positions."""
    return load_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp("win"), **WINDOWED))


@pytest.fixture(scope="module")
def win_model(impl, win_ckpt):
    return impl.Qwen3Model(win_ckpt)


def band(L, S, window) -> np.ndarray:
    """Which of S keys each of L queries at the end sees (NumPy, bool [L, S])."""
    q = np.arange(S - L, S)[:, None]
    k = np.arange(S)[None, :]
    return (k <= q) & (k > q - window)


# --- Task 1: the mask --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "L, S, window",
    [(1, 20, 8), (5, 5, 8), (6, 20, 8), (12, 12, 4), (3, 9, 1), (4, 30, 30), (2, 7, 20)],
    ids=["decode", "chunk-inside", "chunk-past", "prompt", "window-1", "window-S", "wide"],
)
def test_window_mask_sees_each_query_and_the_window_before_it(impl, L, S, window):
    with pytest.raises(ValueError):
        impl.window_mask(L, S, 0)  # a window holds at least the query's own position
    for bad_l in (0, S + 1):
        with pytest.raises(ValueError):
            impl.window_mask(bad_l, S, window)
            pytest.fail(f"window_mask({bad_l}, {S}, {window}): refuse L < 1 and S < L")
    got = np.array(impl.window_mask(L, S, window))
    assert got.shape == (L, S), f"window_mask({L}, {S}, {window}) must be [L, S], got {got.shape}"
    want = band(L, S, window)
    seen = got == 0
    assert np.isneginf(got[~seen]).all(), "masked entries must be -inf, visible ones 0"
    for i in range(L):
        if (seen[i] != want[i]).any():
            pos = S - L + i
            raise AssertionError(
                f"query {i} (position {pos}) with a window of {window} must see keys "
                f"{max(0, pos - window + 1)}..{pos} ({min(window, pos + 1)} positions: its "
                f"own and the {min(window, pos + 1) - 1} before), it sees "
                f"{np.nonzero(seen[i])[0].tolist()}"
            )


def test_window_mask_comes_in_the_dtype_asked_for(impl):
    got = impl.window_mask(3, 9, 4, dtype=mx.float16)
    assert got.dtype == mx.float16, (
        f"window_mask(..., dtype=mx.float16) returned {got.dtype}: build the mask in `dtype` "
        "(it is added to scores of that dtype)"
    )


# --- Task 2: flash attention over the band -------------------------------------------------------


def fused_banded(q, k, v, window, scale=None):
    L, S = q.shape[2], k.shape[2]
    mask = mx.where(mx.array(band(L, S, window)), 0.0, -mx.inf)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize(
    "L, S, window, block",
    [
        (1, 40, 8, 4),
        (1, 40, 9, 4),
        (7, 40, 8, 4),
        (40, 40, 8, 4),
        (9, 33, 16, 8),
        (5, 12, 30, 4),
        (16, 64, 1, 8),
    ],
    ids=[
        "decode",
        "decode-block-at-diagonal",
        "chunk",
        "prompt",
        "gqa-blocks",
        "window-past-start",
        "window-1",
    ],
)
def test_windowed_attention_equals_fused_attention_with_a_band(impl, L, S, window, block):
    keys = mx.random.split(mx.random.key(L * 100 + S), 3)
    q = mx.random.normal((1, 4, L, 16), key=keys[0])
    k = mx.random.normal((1, 2, S, 16), key=keys[1])
    v = mx.random.normal((1, 2, S, 16), key=keys[2])
    got = impl.windowed_attention(q, k, v, window, block_size=block)
    assert_close(
        got, fused_banded(q, k, v, window),
        f"windowed attention (L={L}, S={S}, window={window}, block {block}) vs MLX's fused "
        "attention with the banded mask", atol=1e-5, rtol=1e-5,
    )  # fmt: skip


def test_windowed_attention_uses_the_scale_it_is_given(impl):
    keys = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((1, 4, 6, 16), key=keys[0])
    k = mx.random.normal((1, 2, 20, 16), key=keys[1])
    v = mx.random.normal((1, 2, 20, 16), key=keys[2])
    got = impl.windowed_attention(q, k, v, 8, scale=0.5, block_size=4)
    assert_close(
        got, fused_banded(q, k, v, 8, scale=0.5),
        "windowed attention with scale=0.5 vs MLX's fused attention with the banded mask (use "
        "`scale` when it is given, 1 / sqrt(D) only when it is None)", atol=1e-5, rtol=1e-5,
    )  # fmt: skip


def test_key_blocks_before_the_window_are_not_read(impl):
    """Keys that no query of the chunk can see hold NaN: reading them (even masked: 0 * NaN is
    NaN) poisons the output. Blocks wholly before the band must be skipped."""
    L, S, window, block = 4, 64, 8, 8
    keys = mx.random.split(mx.random.key(5), 3)
    q = mx.random.normal((1, 2, L, 16), key=keys[0])
    k = mx.random.normal((1, 2, S, 16), key=keys[1])
    v = mx.random.normal((1, 2, S, 16), key=keys[2])
    lowest = S - L - window + 1  # the first key any query sees
    unseen = (lowest // block) * block  # keys 0 .. unseen - 1 lie in blocks wholly before it
    poisoned = mx.where(mx.arange(S)[:, None] < unseen, mx.nan, v)  # [1, H_kv, S, D]
    got = impl.windowed_attention(q, k, poisoned, window, block_size=block)
    assert not np.isnan(np.array(got)).any(), (
        f"keys 0..{unseen - 1} are in key blocks wholly before every query's window: "
        "windowed_attention must not read them (start at the first block the band reaches)"
    )
    assert_close(got, fused_banded(q, k, v, window), "keys before the window ignored", 1e-5, 1e-5)


# --- the model with windows ---------------------------------------------------------------------


def oracle_logits(ckpt, tokens):
    """mlx-lm's Qwen3 layers, each run with an explicit mask: banded on the windowed layers."""
    theirs = mlx_lm_qwen3(ckpt)
    L = tokens.shape[1]
    h = theirs.model.embed_tokens(tokens)
    for i, layer in enumerate(theirs.model.layers):
        window = ckpt.config.window(i)
        h = layer(h, mx.where(mx.array(band(L, L, window or L)), 0.0, -mx.inf), None)
    return theirs.model.embed_tokens.as_linear(theirs.model.norm(h))


def test_windowed_layers_equal_mlx_lm_with_banded_masks(impl, win_ckpt, win_model):
    """A 33-token prompt (4 windows long) one-shot and in chunks starting inside, at and past
    the window, with dense and paged caches."""
    tokens = mx.array([list(range(5, 38))])
    want = oracle_logits(win_ckpt, tokens)
    got = win_model(tokens, 0, win_model.create_kv_cache())
    assert_close(got, want, "one-shot logits with sliding windows vs mlx-lm's layers + bands")
    pools = win_model.create_kv_pools(page_size=4)
    for cache, kind in [(win_model.create_kv_cache(), "dense"), (win_model.create_paged_kv_cache(pools), "paged")]:  # fmt: skip
        parts, start = [], 0
        for size in (5, 3, 1, 9, 1, 14):
            parts.append(win_model(tokens[:, start : start + size], start, cache))
            start += size
        assert_close(mx.concatenate(parts, axis=1), want, f"chunked prefill ({kind} caches)")
    with pytest.raises(ValueError, match="sliding window"):
        impl.Qwen3ModelWeek1(win_ckpt)  # it would attend to every position: refused
    with pytest.raises(ValueError, match="sliding-window"):
        impl.Qwen3Model(win_ckpt, kv_bits=8, kv_group_size=32)
    with pytest.raises(ValueError, match="prefix caching"):
        win_model.create_kv_pools(page_size=4, prefix_cache=True)


def test_batched_equals_alone_under_both_policies(impl, win_model, win_ckpt):
    tok = win_ckpt.tokenizer
    prompts = [prompt_with_tokens(tok, n) for n in (3, 21, 9, 14)]
    run = lambda ps, **kw: [
        text
        for _, text in impl.batch_generate(
            win_model,
            tok,
            ps,
            96,
            batch_size=3,
            prefill_step=6,
            max_new_tokens=20,
            ignore_eos=True,
            **kw,
        )  # fmt: skip
    ]
    alone = [run([p])[0] for p in prompts]
    for policy in ("alternate", "hybrid"):
        for paged in (False, True):
            pools = win_model.create_kv_pools(page_size=4) if paged else None
            got = run(prompts, policy=policy, pools=pools)
            assert got == alone, f"{policy}, {'paged' if paged else 'dense'}: batched != alone"


# --- Task 3: pages that leave the window go back ----------------------------------------------


def test_windowed_pages_go_back_while_the_request_decodes(impl, win_model, win_ckpt):
    """Decode 60 tokens after a 5-token prompt, pages of 4: a full-attention layer's pages grow
    with the sequence, a windowed layer's stay at what its window, a chunk and a page span."""
    pools = win_model.create_kv_pools(page_size=4, max_pages=64)
    cache = win_model.create_paged_kv_cache(pools)
    tokens, peak = list(range(5, 10)), [0, 0, 0]
    logits = win_model(mx.array([tokens]), 0, cache)
    for _ in range(60):
        tokens.append(mx.argmax(logits[0, -1]).item())
        logits = win_model(mx.array([tokens[-1:]]), len(tokens) - 1, cache)
        peak = [max(p, pool.num_in_use) for p, pool in zip(peak, pools)]
        offset = len(tokens) - 1  # the cache's offset when this step released pages
        want = max(0, offset - W + 1) // 4  # pages wholly before the step's first visible key
        released = [c.released for c in cache if hasattr(c, "released")]
        assert released == [want] * len(released), (
            f"at offset {offset} (window {W}, pages of 4) the windowed layers have released "
            f"{released} pages, want {want}: a page goes back as soon as all its positions are "
            "before offset - window + 1, the first key the next query sees (not one step later)"
        )
    held = [pool.num_in_use for pool in pools]
    assert held[0] == -(-len(tokens) // 4), f"the full-attention layer holds every page: {held}"
    most = -(-W // 4) + 1  # the window's pages, plus the page the window starts inside
    assert max(peak[1:]) <= most, (
        f"windowed layers peaked at {peak[1:]} pages of 4 tokens for a window of {W}: pages "
        "whose positions all left the window must go back to the pool before each append "
        f"(expected at most {most})"
    )
    for layer_cache in cache:
        layer_cache.release()
    assert [pool.num_in_use for pool in pools] == [0, 0, 0], (
        "releasing the request must free every page it still holds, and only those (a page "
        "given back earlier may belong to another request by now)"
    )


def test_a_rewind_within_the_window_keeps_the_text(impl, win_model, win_ckpt):
    """Speculative decoding (4.5) rewinds rejected guesses: with windowed paged layers the
    greedy text is the plain one, from a prompt shorter than the window (its rewinds go below
    W - 1 tokens, where nothing has left the window yet) and from longer ones."""
    tok = win_ckpt.tokenizer
    prompts = [prompt_with_tokens(tok, n) for n in (2, 12, 25)]
    plain = impl.batch_generate(
        win_model, tok, prompts, 96, 2, 8, win_model.create_kv_pools(page_size=4),
        max_new_tokens=24, ignore_eos=True, policy="hybrid",
    )  # fmt: skip
    guessed = impl.batch_generate(
        win_model, tok, prompts, 96, 2, 8, win_model.create_kv_pools(page_size=4),
        max_new_tokens=24, ignore_eos=True, policy="hybrid",
        speculative=impl.PromptLookup(num_draft_tokens=4),
    )  # fmt: skip
    assert guessed == plain, "speculative decoding over windowed paged layers changed the text"


# --- Tasks 4 and 5: ring attention, two ranks ----------------------------------------------------


def test_split_and_a_group_of_one(impl, win_ckpt, tiny_gqa_ckpt):
    assert impl.split_sequence(11, 2) == [(0, 6), (6, 11)]
    assert impl.split_sequence(9, 3) == [(0, 3), (3, 6), (6, 9)]
    group = mx.distributed.init()  # not launched: a group of one
    model = impl.Qwen3Model(tiny_gqa_ckpt)
    ids = tiny_gqa_ckpt.tokenizer.encode(prompt_with_tokens(tiny_gqa_ckpt.tokenizer, 13))
    caches, logits = impl.ring_prefill(model, ids, group)
    want = model(mx.array([ids]), 0, model.create_kv_cache())[:, -1, :]
    assert_close(logits, want, "ring prefill over a group of one vs the plain model")
    got = impl.ring_generate(model, ids, group, 5)
    cache, want_tokens = model.create_kv_cache(), []
    step = model(mx.array([ids]), 0, cache)
    for i in range(5):
        want_tokens.append(mx.argmax(step[0, -1]).item())
        step = model(mx.array([want_tokens[-1:]]), len(ids) + i, cache)
    assert got == want_tokens, f"ring_generate {got} != greedy with a cache {want_tokens}"
    with pytest.raises(ValueError, match="sliding windows"):
        impl.ring_prefill(impl.Qwen3Model(win_ckpt), ids, group)


def test_two_ranks_equal_one(impl, tmp_path_factory):
    """tests/tp_ranks.py --checks ring under mlx.launch: ring attention and merge_ranks alone on
    a random batch of two against MLX's fused attention; ring prefill of a prompt split in two
    equals one-process prefill, the decode after it gives the same logits and tokens, and each
    rank holds only its part's keys and values."""
    tmp = tmp_path_factory.mktemp("ring-ranks")
    args = ["--impl", impl.__name__, "--out", str(tmp), "--checks", "ring"]
    args += ["--ckpt", str(make_tiny_checkpoint(tmp / "tiny", seed=0))]
    names = [check.__name__ for check in tp_ranks.RING_CHECKS]
    problems = rank_check_problems(Path(tp_ranks.__file__), args, tmp, names)
    assert not problems, "\n\n".join(problems)


def test_three_ranks_equal_one(impl, tmp_path_factory):
    """tests/tp_ranks.py --checks ring3 on three ranks (the tasks alone on 10 tokens split 4/3/3,
    the prefill on 11 split 4/4/3): a block travels two steps, so passing on your own block
    instead of the one received, labelling a block with the wrong part or asking recv for the
    wrong shape all fail here, where two ranks hide them."""
    tmp = tmp_path_factory.mktemp("ring-3-ranks")
    args = ["--impl", impl.__name__, "--out", str(tmp), "--checks", "ring3"]
    args += ["--ckpt", str(make_tiny_checkpoint(tmp / "tiny", seed=0))]
    names = [check.__name__ for check in tp_ranks.RING_CHECKS_3]
    problems = rank_check_problems(Path(tp_ranks.__file__), args, tmp, names, 3, timeout=180)
    assert not problems, "\n\n".join(problems)

"""Week 1 Day 1: softmax, linear, scaled dot-product attention, multi-head attention.

Oracles: mx.softmax, numpy, mx.fast.scaled_dot_product_attention and mlx.nn.MultiHeadAttention.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

ATOL = 1e-5
SEEDS = [0, 1, 2]


def randn(shape, key) -> mx.array:
    return mx.random.normal(shape, key=key)


def keys(seed: int, n: int) -> list:
    return list(mx.random.split(mx.random.key(seed), n))


def assert_close(actual: mx.array, expected, atol: float = ATOL, rtol: float = 1e-5) -> None:
    expected = np.asarray(expected)
    actual = np.asarray(actual.astype(mx.float32)) if isinstance(actual, mx.array) else actual
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol)


def to_4d(x: mx.array) -> mx.array:
    """[..., L, D] -> [B, H, L, D] for the fused oracle, which wants exactly four axes."""
    lead = x.shape[:-2]
    if len(lead) == 0:
        return x.reshape(1, 1, *x.shape[-2:])
    if len(lead) == 1:
        return x.reshape(1, *x.shape)
    return x.reshape(-1, x.shape[-3], *x.shape[-2:])


def fast_sdpa(q, k, v, scale, mask=None) -> mx.array:
    out = mx.fast.scaled_dot_product_attention(to_4d(q), to_4d(k), to_4d(v), scale=scale, mask=mask)
    return out.reshape(*q.shape[:-1], v.shape[-1])


# --- Task 1: softmax ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "shape, axis",
    [((7,), -1), ((3, 11), -1), ((3, 11), 0), ((2, 3, 5, 9), -1), ((2, 3, 5, 9), 1)],
)
def test_task_1_softmax_matches_mlx(impl, seed, shape, axis):
    x = randn(shape, mx.random.key(seed)) * 4.0
    y = impl.softmax(x, axis=axis)
    assert y.dtype == mx.float32, "softmax returns the input's dtype"
    assert_close(y, mx.softmax(x, axis=axis))


def test_task_1_softmax_default_axis_is_last(impl):
    x = randn((4, 6), mx.random.key(3))
    assert_close(impl.softmax(x), mx.softmax(x, axis=-1))


def test_task_1_softmax_huge_logits_stay_finite(impl):
    # exp(1e4) overflows float32: only a max-subtracting softmax survives these rows.
    x = mx.array(
        [
            [1e4, 1e4 - 1.0, 1e4 - 3.0, 0.0],
            [-1e4, -1e4, -1e4 + 2.0, -1e4],  # every exp underflows to 0 without the shift
            [5e3, -5e3, 0.0, 5e3],
        ],
        dtype=mx.float32,
    )
    y = impl.softmax(x, axis=-1)
    out = np.asarray(y)
    assert np.all(np.isfinite(out)), f"softmax produced inf/nan on large logits: {out}"
    np.testing.assert_allclose(out.sum(axis=-1), np.ones(3), atol=1e-6)
    ref = np.asarray(x, dtype=np.float64)
    ref = np.exp(ref - ref.max(axis=-1, keepdims=True))
    ref /= ref.sum(axis=-1, keepdims=True)
    assert_close(y, ref.astype(np.float32), atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_task_1_softmax_keeps_low_precision_dtype(impl, dtype):
    x32 = randn((3, 257), mx.random.key(4)) * 8.0
    x = x32.astype(dtype)
    y = impl.softmax(x, axis=-1)
    assert y.dtype == dtype, f"softmax of {dtype} input returned {y.dtype}"
    expected = mx.softmax(x.astype(mx.float32), axis=-1)
    assert_close(y, expected, atol=1e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(y.astype(mx.float32)).sum(axis=-1), 1.0, atol=2e-2)


# --- Task 2: linear -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("x_shape", [(5,), (4, 5), (2, 3, 5)])
def test_task_2_linear_without_bias(impl, seed, x_shape):
    kx, kw = keys(seed, 2)
    x = randn(x_shape, kx)
    w = randn((7, 5), kw)  # [O, I]: the checkpoint layout, not square on purpose
    y = impl.linear(x, w)
    assert_close(y, np.asarray(x) @ np.asarray(w).T)


@pytest.mark.parametrize("seed", SEEDS)
def test_task_2_linear_with_bias(impl, seed):
    kx, kw, kb = keys(seed, 3)
    x = randn((2, 3, 6), kx)
    w = randn((4, 6), kw)
    b = randn((4,), kb)
    y = impl.linear(x, w, b)
    assert_close(y, np.asarray(x) @ np.asarray(w).T + np.asarray(b))
    # None means no bias, the same as leaving it out
    assert_close(impl.linear(x, w, None), np.asarray(x) @ np.asarray(w).T)


# --- Task 3: scaled dot-product attention -------------------------------------------------------

SDPA_SHAPES = [
    # (batch dims, L, S, D)
    ((), 4, 4, 8),
    ((3,), 5, 7, 16),
    ((2, 3), 6, 9, 16),
    ((2, 3), 1, 10, 32),  # one query over many keys: a decode step
]


def qkv(batch, L, S, D, seed):
    kq, kk, kv = keys(seed, 3)
    return randn((*batch, L, D), kq), randn((*batch, S, D), kk), randn((*batch, S, D), kv)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("batch, L, S, D", SDPA_SHAPES)
def test_task_3_sdpa_default_scale(impl, seed, batch, L, S, D):
    q, k, v = qkv(batch, L, S, D, seed)
    out = impl.scaled_dot_product_attention_simple(q, k, v)
    assert out.shape == (*batch, L, D)
    assert_close(out, fast_sdpa(q, k, v, scale=1.0 / math.sqrt(D)))


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("batch, L, S, D", SDPA_SHAPES[1:3])
def test_task_3_sdpa_explicit_scale(impl, scale, batch, L, S, D):
    q, k, v = qkv(batch, L, S, D, seed=5)
    out = impl.scaled_dot_product_attention_simple(q, k, v, scale=scale)
    assert_close(out, fast_sdpa(q, k, v, scale=scale))


def random_additive_mask(shape, seed) -> mx.array:
    """Finite biases with about a third of the entries at -inf; column 0 always stays visible."""
    kb, kd = keys(seed, 2)
    bias = randn(shape, kb)
    drop = mx.random.uniform(shape=shape, key=kd) < 0.35
    first_col = mx.arange(shape[-1]) == 0
    drop = mx.logical_and(drop, mx.logical_not(first_col))
    return mx.where(drop, mx.array(-mx.inf), bias)


@pytest.mark.parametrize("seed", SEEDS)
def test_task_3_sdpa_additive_mask(impl, seed):
    batch, L, S, D = (2, 3), 5, 8, 16
    q, k, v = qkv(batch, L, S, D, seed)
    scale = 1.0 / math.sqrt(D)
    for mask_shape in [(L, S), (2, 1, L, S), (*batch, L, S)]:
        mask = random_additive_mask(mask_shape, seed + 10)
        out = impl.scaled_dot_product_attention_simple(q, k, v, mask=mask)
        assert_close(out, fast_sdpa(q, k, v, scale=scale, mask=mask))
    # scale and mask together
    mask = random_additive_mask((L, S), seed + 20)
    out = impl.scaled_dot_product_attention_simple(q, k, v, scale=0.5, mask=mask)
    assert_close(out, fast_sdpa(q, k, v, scale=0.5, mask=mask))


def test_task_3_sdpa_masked_keys_are_ignored(impl):
    # Changing a value the mask hides must not change the output.
    L, S, D = 3, 6, 8
    q, k, v = qkv((2,), L, S, D, seed=7)
    mask = mx.where(mx.arange(S) >= 4, mx.array(-mx.inf), mx.array(0.0))[None, :]  # [1, S]
    out = impl.scaled_dot_product_attention_simple(q, k, v, mask=mask)
    v2 = mx.concatenate([v[:, :4], v[:, 4:] + 100.0], axis=1)
    k2 = mx.concatenate([k[:, :4], k[:, 4:] * -3.0], axis=1)
    out2 = impl.scaled_dot_product_attention_simple(q, k2, v2, mask=mask)
    assert_close(out2, out)
    assert_close(out, fast_sdpa(q, k[:, :4], v[:, :4], scale=1.0 / math.sqrt(D)))


# --- Task 4: multi-head attention ---------------------------------------------------------------


def mha_pair(impl, E, H, seed):
    """Our SimpleMultiHeadAttention and mlx.nn.MultiHeadAttention sharing the same weights."""
    wq, wk, wv, wo = (randn((E, E), k) * (1.0 / math.sqrt(E)) for k in keys(seed, 4))
    ours = impl.SimpleMultiHeadAttention(E, H, wq, wk, wv, wo)
    oracle = nn.MultiHeadAttention(E, H, bias=False)
    oracle.query_proj.weight = wq  # nn.Linear stores weights as [out, in] too
    oracle.key_proj.weight = wk
    oracle.value_proj.weight = wv
    oracle.out_proj.weight = wo
    return ours, oracle


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("N, L, S, E, H", [(1, 4, 4, 16, 2), (2, 5, 5, 32, 4), (3, 3, 7, 24, 3)])
def test_task_4_multi_head_attention(impl, seed, N, L, S, E, H):
    ours, oracle = mha_pair(impl, E, H, seed)
    kq, kk, kv = keys(seed + 100, 3)
    query, key, value = randn((N, L, E), kq), randn((N, S, E), kk), randn((N, S, E), kv)
    out = ours(query, key, value)
    assert out.shape == (N, L, E)
    assert_close(out, oracle(query, key, value))


@pytest.mark.parametrize("seed", SEEDS)
def test_task_4_multi_head_attention_self_attention_with_mask(impl, seed):
    N, L, E, H = 2, 6, 32, 4
    ours, oracle = mha_pair(impl, E, H, seed)
    x = randn((N, L, E), mx.random.key(seed + 200))
    causal = nn.MultiHeadAttention.create_additive_causal_mask(L)  # [L, L]
    assert_close(ours(x, x, x, mask=causal), oracle(x, x, x, mask=causal))
    per_head = random_additive_mask((N, H, L, L), seed + 300)  # a different mask for every head
    assert_close(ours(x, x, x, mask=per_head), oracle(x, x, x, mask=per_head))

"""Week 1 Day 3: grouped-query attention by reshaping, with a square causal mask.

Oracle: mx.fast.scaled_dot_product_attention, which takes K/V with fewer heads than Q and
mask="causal". It wants exactly [B, H, L, D], so extra batch axes are flattened for it.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

ATOL = 1e-5
SEEDS = [0, 1, 2]


def randn(shape, key) -> mx.array:
    return mx.random.normal(shape, key=key)


def assert_close(actual: mx.array, expected: mx.array, atol: float = ATOL, rtol: float = 1e-5):
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=rtol)


def make_qkv(batch, h_q, h_kv, L, S, D, seed):
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = randn((*batch, h_q, L, D), kq)
    k = randn((*batch, h_kv, S, D), kk)
    v = randn((*batch, h_kv, S, D), kv)
    return q, k, v


def oracle(q, k, v, scale=None, mask=None) -> mx.array:
    """Fused MLX attention on [B, H, L, D] views of inputs with any number of batch axes."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    flat = lambda x: x.reshape(-1, *x.shape[-3:])
    if isinstance(mask, mx.array) and mask.ndim > 4:
        mask = mask.reshape(-1, *mask.shape[-3:])
    out = mx.fast.scaled_dot_product_attention(flat(q), flat(k), flat(v), scale=scale, mask=mask)
    return out.reshape(q.shape)


HEADS = [(8, 2), (6, 3), (4, 4), (4, 1)]
BATCHES = [(), (2,), (2, 3)]


# --- Task 1: grouped-query attention -------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("batch", BATCHES, ids=["no-batch", "B", "B1xB2"])
@pytest.mark.parametrize("h_q, h_kv", HEADS, ids=[f"{a}q-{b}kv" for a, b in HEADS])
def test_task_1_gqa_no_mask(impl, seed, batch, h_q, h_kv):
    q, k, v = make_qkv(batch, h_q, h_kv, L=5, S=7, D=16, seed=seed)
    out = impl.scaled_dot_product_attention_grouped(q, k, v)
    assert out.shape == q.shape, "the output has the query's shape [..., H_q, L, D]"
    assert_close(out, oracle(q, k, v))


@pytest.mark.parametrize("scale", [0.1, 0.5])
@pytest.mark.parametrize("h_q, h_kv", [(8, 2), (6, 3)])
def test_task_1_gqa_explicit_scale(impl, scale, h_q, h_kv):
    q, k, v = make_qkv((2,), h_q, h_kv, L=4, S=6, D=32, seed=3)
    out = impl.scaled_dot_product_attention_grouped(q, k, v, scale=scale)
    assert_close(out, oracle(q, k, v, scale=scale))


def test_task_1_gqa_groups_consecutive_query_heads(impl):
    # Query heads 0..n_rep-1 share KV head 0, the next n_rep share KV head 1, and so on
    # (the grouped layout of Qwen's q_proj). Give every KV head a constant value to read it off.
    h_q, h_kv, L, S, D = 6, 3, 2, 4, 8
    q, k, _ = make_qkv((), h_q, h_kv, L, S, D, seed=4)
    v = mx.broadcast_to(mx.arange(h_kv, dtype=mx.float32)[:, None, None], (h_kv, S, D))
    out = impl.scaled_dot_product_attention_grouped(q, k, v)
    kv_head_of_query_head = np.asarray(out[:, 0, 0]).round().astype(int).tolist()
    assert kv_head_of_query_head == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("batch", BATCHES, ids=["no-batch", "B", "B1xB2"])
@pytest.mark.parametrize("h_q, h_kv", HEADS, ids=[f"{a}q-{b}kv" for a, b in HEADS])
def test_task_1_gqa_causal(impl, seed, batch, h_q, h_kv):
    q, k, v = make_qkv(batch, h_q, h_kv, L=6, S=6, D=16, seed=seed)
    out = impl.scaled_dot_product_attention_grouped(q, k, v, mask="causal")
    assert_close(out, oracle(q, k, v, mask="causal"))


def test_task_1_gqa_causal_hides_the_future(impl):
    # Row i of a causal attention must not change when keys/values after i change.
    q, k, v = make_qkv((1,), 4, 2, L=5, S=5, D=8, seed=5)
    out = impl.scaled_dot_product_attention_grouped(q, k, v, mask="causal")
    k2 = mx.concatenate([k[..., :3, :], k[..., 3:, :] * 5.0], axis=-2)
    v2 = mx.concatenate([v[..., :3, :], v[..., 3:, :] + 50.0], axis=-2)
    out2 = impl.scaled_dot_product_attention_grouped(q, k2, v2, mask="causal")
    assert_close(out2[..., :3, :], out[..., :3, :])
    # and the first query sees only the first key, so it returns the first value
    assert_close(out[..., 0, :], mx.repeat(v[..., 0, :], 2, axis=1))


def additive_mask(shape, seed) -> mx.array:
    """Random finite biases with some -inf entries; key 0 always stays visible."""
    kb, kd = mx.random.split(mx.random.key(seed), 2)
    drop = mx.random.uniform(shape=shape, key=kd) < 0.35
    drop = mx.logical_and(drop, mx.arange(shape[-1]) != 0)
    return mx.where(drop, mx.array(-mx.inf), randn(shape, kb))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("h_q, h_kv", HEADS, ids=[f"{a}q-{b}kv" for a, b in HEADS])
def test_task_1_gqa_array_mask(impl, seed, h_q, h_kv):
    batch, L, S, D = (2,), 5, 7, 16
    q, k, v = make_qkv(batch, h_q, h_kv, L, S, D, seed)
    # shared by every head, per batch row, and one mask for every query head
    for shape in [(L, S), (2, 1, L, S), (2, h_q, L, S)]:
        mask = additive_mask(shape, seed + 10)
        out = impl.scaled_dot_product_attention_grouped(q, k, v, mask=mask)
        assert_close(out, oracle(q, k, v, mask=mask))


def test_task_1_gqa_array_mask_with_two_batch_axes(impl):
    batch, h_q, h_kv, L, S, D = (2, 3), 8, 2, 4, 6, 16
    q, k, v = make_qkv(batch, h_q, h_kv, L, S, D, seed=6)
    mask = additive_mask((*batch, h_q, L, S), seed=7)
    out = impl.scaled_dot_product_attention_grouped(q, k, v, scale=0.3, mask=mask)
    assert_close(out, oracle(q, k, v, scale=0.3, mask=mask))


def test_task_1_gqa_does_not_copy_kv(impl, monkeypatch):
    # GQA saves memory only if K/V are never expanded to one copy per query head:
    # reshape the query into groups instead. Every way of copying K/V fails here.
    batch, h_q, h_kv, L, S, D = (2,), 8, 2, 5, 7, 16
    q, k, v = make_qkv(batch, h_q, h_kv, L, S, D, seed=8)
    mask = additive_mask((L, S), seed=9)
    expected = [oracle(q, k, v), oracle(q, k, v, mask=mask)]
    mx.eval(expected)

    def refuse(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"mx.{name} was called: GQA must not copy K/V per query head")

        return fail

    real_broadcast_to = mx.broadcast_to

    def broadcast_to(a, shape, *args, **kwargs):
        if tuple(shape[-2:]) == (S, D):  # the shape of a K/V head, not of a mask
            raise AssertionError("K/V were broadcast to more heads: reshape the query instead")
        return real_broadcast_to(a, shape, *args, **kwargs)

    for name in ["repeat", "tile", "concatenate", "stack"]:
        monkeypatch.setattr(mx, name, refuse(name))
    monkeypatch.setattr(mx, "broadcast_to", broadcast_to)
    out = impl.scaled_dot_product_attention_grouped(q, k, v)
    out_masked = impl.scaled_dot_product_attention_grouped(q, k, v, mask=mask)
    monkeypatch.undo()
    assert_close(out, expected[0])
    assert_close(out_masked, expected[1])


# --- errors --------------------------------------------------------------------------------------


def test_task_1_gqa_heads_not_a_multiple_raise(impl):
    q, k, v = make_qkv((1,), 6, 4, L=3, S=3, D=8, seed=10)
    with pytest.raises(ValueError, match="multiple"):
        impl.scaled_dot_product_attention_grouped(q, k, v)


def test_task_1_gqa_causal_refuses_more_queries_than_keys(impl):
    # L > S would put the first queries before the first key, with nothing to see.
    q, k, v = make_qkv((1,), 4, 2, L=5, S=3, D=8, seed=11)
    with pytest.raises(ValueError, match=r"(?i)causal.*L=5.*S=3"):
        impl.scaled_dot_product_attention_grouped(q, k, v, mask="causal")

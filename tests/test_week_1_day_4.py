"""Week 1 Day 4: RMSNorm, silu and the SwiGLU MLP.

Oracles: mx.fast.rms_norm, mlx.nn.silu and mlx-lm's Qwen3 MLP with the same weights.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.qwen3 import MLP


def _normal(shape, seed, scale=1.0, offset=0.0, dtype=mx.float32):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale + offset).astype(dtype)


def _norm_weight(dim, seed, dtype=mx.float32):
    return _normal((dim,), seed, scale=0.3, offset=1.0, dtype=dtype)


# --- Task 1: RMSNorm ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(7, 48), (2, 5, 96), (2, 5, 3, 32)],  # tokens, a batch, per-head (QK-norm shape)
    ids=["L,E", "B,L,E", "B,L,H,D"],
)
def test_rmsnorm_matches_mx_fast(impl, shape):
    dim = shape[-1]
    x = _normal(shape, seed=1, scale=2.0, offset=0.5)
    weight = _norm_weight(dim, seed=2)
    y = impl.RMSNorm(dim, weight, eps=1e-6)(x)
    assert y.shape == x.shape and y.dtype == mx.float32, "RMSNorm keeps the shape and dtype"
    expected = mx.fast.rms_norm(x, weight, 1e-6)
    np.testing.assert_allclose(np.array(y), np.array(expected), rtol=1e-5, atol=1e-5)


def test_rmsnorm_eps_inside_the_square_root(impl):
    """Tiny activations with a large eps: eps must be added to mean(x^2), under the root."""
    dim, eps = 64, 1e-2
    x = _normal((4, dim), seed=3, scale=1e-2)
    x = mx.concatenate([x, mx.zeros((1, dim))])  # an all-zero row must give zeros, not NaN
    weight = _norm_weight(dim, seed=4)
    y = impl.RMSNorm(dim, weight, eps=eps)(x)
    expected = mx.fast.rms_norm(x, weight, eps)
    np.testing.assert_allclose(np.array(y), np.array(expected), rtol=1e-5, atol=1e-6)
    assert not mx.any(mx.isnan(y)).item(), "an all-zero row produced NaN: is eps missing?"
    np.testing.assert_array_equal(np.array(y[-1]), np.zeros(dim, dtype=np.float32))


def test_rmsnorm_bf16_is_computed_in_float32_and_rounded_once(impl):
    """bf16 in, bf16 out, but every intermediate in float32.

    Expected: the float32 result (mx.fast.rms_norm on the upcast input) rounded to bf16 once.
    Computing x*x, the mean or the products in bf16 rounds several times and misses about
    a third of the elements by one bf16 step.
    """
    dim = 2048
    x = _normal((8, dim), seed=5, scale=300.0, offset=100.0, dtype=mx.bfloat16)
    weight = _norm_weight(dim, seed=6, dtype=mx.bfloat16)
    y = impl.RMSNorm(dim, weight, eps=1e-6)(x)
    assert y.dtype == mx.bfloat16, f"output dtype {y.dtype}, expected the input's bf16"
    exact = mx.fast.rms_norm(x.astype(mx.float32), weight.astype(mx.float32), 1e-6)
    rounded_once = exact.astype(mx.bfloat16)
    same = mx.mean(y == rounded_once).item()
    assert same >= 0.99, (
        f"only {same:.1%} of the outputs equal the float32 result rounded once to bf16: "
        "cast x (and the weight) to float32 first and cast back only at the very end"
    )
    # and every element is within one bf16 step (2^-7 relative) of the exact value
    rel = mx.abs(y.astype(mx.float32) - exact) / mx.maximum(mx.abs(exact), 1e-6)
    assert mx.max(rel).item() <= 2.0**-7, (
        "an output is more than one bf16 step off: compute in float32, cast back once at the end"
    )
    # the oracle rounds once more inside, so it agrees only to about two bf16 steps
    fast = mx.fast.rms_norm(x, weight, 1e-6).astype(mx.float32)
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(fast), rtol=2e-2)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_rmsnorm_large_half_precision_values_do_not_overflow(impl, dtype):
    """x = 400 squares to 160000, beyond float16's largest value 65504: square in float32."""
    dim = 256
    x = _normal((4, dim), seed=7, scale=400.0, dtype=dtype)
    weight = _norm_weight(dim, seed=8, dtype=mx.float32)  # float32 weight, half input
    y = impl.RMSNorm(dim, weight, eps=1e-6)(x)
    assert y.dtype == dtype, f"output dtype {y.dtype}, expected the input's {dtype}"
    exact = mx.fast.rms_norm(x.astype(mx.float32), weight, 1e-6)
    np.testing.assert_allclose(
        np.array(y.astype(mx.float32)), np.array(exact), rtol=1e-2, atol=1e-2
    )


# --- Task 2: silu ---------------------------------------------------------------------------


def test_silu_matches_mlx_nn(impl):
    x = mx.concatenate([mx.linspace(-30.0, 30.0, 121), _normal((200,), seed=9, scale=3.0)])
    y = impl.silu(x)
    assert y.shape == x.shape and y.dtype == mx.float32, "silu keeps the shape and dtype"
    np.testing.assert_allclose(np.array(y), np.array(nn.silu(x)), rtol=1e-5, atol=1e-6)
    # very negative inputs give (minus) zero, never NaN
    far = impl.silu(mx.array([-200.0, -1000.0, 200.0]))
    np.testing.assert_allclose(np.array(far), [0.0, 0.0, 200.0], atol=1e-6)


def test_silu_keeps_the_dtype(impl):
    x = _normal((3, 40), seed=10, scale=4.0, dtype=mx.bfloat16)
    y = impl.silu(x)
    assert y.dtype == mx.bfloat16, "silu of bf16 input returns bf16"
    np.testing.assert_allclose(
        np.array(y.astype(mx.float32)),
        np.array(nn.silu(x).astype(mx.float32)),
        rtol=2e-2,
        atol=1e-2,
    )


# --- Task 3: the SwiGLU MLP -----------------------------------------------------------------


def _mlp_pair(impl, dim, hidden, seed):
    w_gate = _normal((hidden, dim), seed, scale=dim**-0.5)
    w_up = _normal((hidden, dim), seed + 1, scale=dim**-0.5)
    w_down = _normal((dim, hidden), seed + 2, scale=hidden**-0.5)
    oracle = MLP(dim, hidden)
    oracle.load_weights(
        [
            ("gate_proj.weight", w_gate),
            ("up_proj.weight", w_up),
            ("down_proj.weight", w_down),
        ],
        strict=True,
    )
    return impl.Qwen3MLP(dim, hidden, w_gate, w_up, w_down), oracle


@pytest.mark.parametrize("shape", [(2, 5, 48), (9, 48), (1, 1, 48)], ids=["B,L,E", "L,E", "one"])
def test_mlp_matches_mlx_lm(impl, shape):
    mlp, oracle = _mlp_pair(impl, dim=48, hidden=80, seed=11)
    x = _normal(shape, seed=12, scale=2.0)
    y = mlp(x)
    assert y.shape == x.shape, "the MLP maps [..., E] back to [..., E]"
    np.testing.assert_allclose(np.array(y), np.array(oracle(x)), rtol=1e-5, atol=1e-5)


def test_mlp_on_a_checkpoint_layer(impl, tiny_gqa_ckpt):
    """The weights of a real (tiny) checkpoint: gate_proj, up_proj, down_proj in [out, in]."""
    c, w = tiny_gqa_ckpt.config, tiny_gqa_ckpt.weights
    p = "model.layers.1.mlp."
    mlp = impl.Qwen3MLP(
        c.hidden_size,
        c.intermediate_size,
        w[p + "gate_proj.weight"],
        w[p + "up_proj.weight"],
        w[p + "down_proj.weight"],
    )
    oracle = MLP(c.hidden_size, c.intermediate_size)
    oracle.load_weights(
        [(k, w[p + k]) for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
    )
    x = _normal((2, 6, c.hidden_size), seed=13)
    np.testing.assert_allclose(np.array(mlp(x)), np.array(oracle(x)), rtol=1e-5, atol=1e-5)

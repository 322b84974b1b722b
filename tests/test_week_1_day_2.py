"""Week 1 Day 2: rotary position embeddings (RoPE) with a position offset.

Oracle: mx.fast.rope, which wants the sequence axis second to last, so x [B, L, H, D] is
transposed to [B, H, L, D] and back.
"""

import mlx.core as mx
import numpy as np
import pytest

ATOL = 1e-5


def randn(shape, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def assert_close(actual: mx.array, expected: mx.array, atol: float = ATOL, rtol: float = 1e-5):
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(
        np.asarray(actual.astype(mx.float32)),
        np.asarray(expected.astype(mx.float32)),
        atol=atol,
        rtol=rtol,
    )


def oracle(x: mx.array, traditional: bool, base: float, offset: int) -> mx.array:
    xt = x.swapaxes(1, 2)  # [B, H, L, D]
    y = mx.fast.rope(xt, x.shape[-1], traditional=traditional, base=base, scale=1.0, offset=offset)
    return y.swapaxes(1, 2)  # [B, L, H, D]


# --- Tasks 1 and 3: the tables and the rotation, compared with mx.fast.rope -------------------


@pytest.mark.parametrize("traditional", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("offset", [0, 7])
@pytest.mark.parametrize("B, L, H, D", [(1, 4, 2, 8), (2, 5, 4, 16), (3, 9, 2, 64)])
def test_task_3_rope_matches_mlx(impl, traditional, offset, B, L, H, D):
    rope = impl.RoPE(D, 32, traditional=traditional)
    x = randn((B, L, H, D), seed=B * 100 + L + offset)
    y = rope(x, offset)
    assert y.shape == x.shape, "RoPE keeps the shape [B, L, H, D]"
    assert y.dtype == x.dtype, "RoPE returns x's dtype"
    assert_close(y, oracle(x, traditional, 10000.0, offset))


@pytest.mark.parametrize("traditional", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("base", [10000.0, 1000000.0, 500.0])
def test_task_1_rope_tables_use_the_base(impl, traditional, base):
    # Qwen3 uses rope_theta = 1e6; a table that ignores `base` fails here.
    B, L, H, D = 2, 6, 3, 32
    rope = impl.RoPE(D, 64, base=base, traditional=traditional)
    x = randn((B, L, H, D), seed=int(base) % 97)
    assert_close(rope(x, 3), oracle(x, traditional, base, 3))


@pytest.mark.parametrize("traditional", [False, True], ids=["half-split", "interleaved"])
def test_task_2_rope_offset_near_the_table_end(impl, traditional):
    seq_len, D = 40, 16
    rope = impl.RoPE(D, seq_len, traditional=traditional)
    x = randn((2, 5, 2, D), seed=11)
    # positions 35..39: the last rows of the table
    assert_close(rope(x, seq_len - 5), oracle(x, traditional, 10000.0, seq_len - 5))
    # one decode step at the very last position
    step = randn((2, 1, 2, D), seed=12)
    assert_close(rope(step, seq_len - 1), oracle(step, traditional, 10000.0, seq_len - 1))


def test_task_2_rope_default_offset_is_zero_and_position_zero_is_identity(impl):
    rope = impl.RoPE(16, 8)
    x = randn((2, 3, 2, 16), seed=13)
    y = rope(x)
    assert_close(y, oracle(x, False, 10000.0, 0))
    assert_close(y[:, 0], x[:, 0])  # angle 0 at position 0: nothing rotates


def test_task_2_rope_offset_is_a_shift_of_positions(impl):
    # Rotating a slice at offset t must equal slicing the rotation of the whole sequence:
    # this is what lets a KV cache (or a prefill chunk) rotate only its new tokens.
    rope = impl.RoPE(32, 24)
    x = randn((2, 12, 2, 32), seed=14)
    whole = rope(x, 0)
    for start, stop in [(0, 5), (5, 6), (6, 12)]:
        assert_close(rope(x[:, start:stop], start), whole[:, start:stop])


@pytest.mark.parametrize("traditional", [False, True], ids=["half-split", "interleaved"])
def test_task_2_rope_scores_depend_on_relative_position(impl, traditional):
    # q at position m and k at position n: the rotated dot product depends on m - n only.
    D = 32
    rope = impl.RoPE(D, 64, traditional=traditional)
    q = randn((1, 1, 1, D), seed=15)
    k = randn((1, 1, 1, D), seed=16)

    def score(m: int, n: int) -> float:
        return (rope(q, m) * rope(k, n)).sum().item()

    assert score(10, 4) == pytest.approx(score(30, 24), abs=1e-4)
    assert score(7, 7) == pytest.approx((q * k).sum().item(), abs=1e-4)
    assert abs(score(10, 4) - score(10, 9)) > 1e-3  # and it does depend on the distance


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_task_2_rope_keeps_low_precision_dtype(impl, dtype):
    rope = impl.RoPE(16, 16)
    x = randn((1, 4, 2, 16), seed=17).astype(dtype)
    y = rope(x, 2)
    assert y.dtype == dtype, f"RoPE of {dtype} input returned {y.dtype}"
    assert_close(y, oracle(x.astype(mx.float32), False, 10000.0, 2), atol=2e-2, rtol=2e-2)


# --- errors --------------------------------------------------------------------------------------


def test_task_2_rope_positions_past_the_table_raise(impl):
    rope = impl.RoPE(16, 32)
    x = randn((1, 5, 2, 16), seed=18)
    rope(x, 27)  # positions 27..31: still inside
    with pytest.raises(ValueError, match="RoPE table"):
        rope(x, 28)  # position 32 does not exist
    with pytest.raises(ValueError, match="RoPE table"):
        rope(randn((1, 40, 2, 16), seed=19), 0)  # longer than the table
    with pytest.raises(ValueError, match="RoPE table"):
        rope(x, -1)


def test_task_2_rope_wrong_head_dim_raises(impl):
    rope = impl.RoPE(16, 32)
    with pytest.raises(ValueError, match="dims"):
        rope(randn((1, 3, 2, 32), seed=20), 0)


def test_task_1_rope_odd_dims_raise(impl):
    with pytest.raises(ValueError, match="even"):
        impl.RoPE(15, 32)


# --- Task 2: positions from one offset, or one offset per row --------------------------------


def test_task_2_positions_one_offset_and_one_per_row(impl):
    rope = impl.RoPE(8, 32)
    np.testing.assert_array_equal(
        np.array(rope.positions(3, 2, 4)), [[3, 4, 5, 6], [3, 4, 5, 6]], "one int: every row"
    )
    np.testing.assert_array_equal(
        np.array(rope.positions([5, 0, 17], 3, 2)),
        [[5, 6], [0, 1], [17, 18]],
        "a list: row b starts at offset[b] (continuous batching, Week 3 Day 1)",
    )


def test_task_3_rope_with_one_offset_per_row_equals_each_row_alone(impl):
    rope = impl.RoPE(32, 64)
    x = randn((3, 4, 2, 32), seed=5)
    starts = [5, 0, 17]
    rotated = rope(x, starts)
    for row, start in enumerate(starts):
        assert_close(rotated[row : row + 1], oracle(x[row : row + 1], False, 10000.0, start))


@pytest.mark.parametrize(
    "offset, why",
    [
        ([1, 2], "two offsets for three rows"),
        (30, "positions 30..33 run past a table of 32"),
        ([0, -1, 0], "a negative position"),
    ],
)
def test_task_2_positions_refuse_bad_offsets(impl, offset, why):
    rope = impl.RoPE(8, 32)
    with pytest.raises(ValueError):
        rope.positions(offset, 3, 4)
        raise AssertionError(f"positions should refuse {why}")

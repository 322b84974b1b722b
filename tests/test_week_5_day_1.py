"""Week 5 Day 1: your own kernel, a quantized matrix-vector product as an MLX primitive in C++.

Task 1  matvec_plain (csrc/quantized_matvec.cpp): the plain loop over MLX's affine format.
Task 2  rows_at_once: R weight rows at once, eight codes per vector operation, the bias out of
        the inner loop.
Task 3  matvec_fast_bits: x as float blocks and group sums, the rows shared among the cores.
Task 4  QuantizedWeight.own_kernel_linear (quantize.py): small passes through the kernel, the
        codes left packed (quantized_linear="own-kernel").

Oracles: mx.quantized_matmul on the same codes (float32), the product in float64 of the
weights mx.dequantize gives (float16 and bfloat16, where MLX's own kernel rounds more than
ours may), and the model on the dequantize-at-load and kernel paths (logits, greedy tokens).
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_close, kernel_tolerance

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
FORMATS = [(g, b) for b in (2, 4, 8) for g in (32, 64, 128)]  # (group_size, bits)


def quantized(rows: int, cols: int, group_size: int, bits: int, dtype, seed: int):
    """A random weight [rows, cols] in MLX's format, and its dequantized values (float64)."""
    w = mx.array(np.random.RandomState(seed).standard_normal((rows, cols)).astype(np.float32))
    codes, scales, biases = mx.quantize(w.astype(dtype), group_size=group_size, bits=bits)
    exact = mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits)
    return (codes, scales, biases), np.array(exact.astype(mx.float32), dtype=np.float64)


def x_rows(rows: int, cols: int, dtype, seed: int) -> mx.array:
    x = np.random.RandomState(seed + 100).standard_normal((rows, cols)).astype(np.float32)
    return mx.array(x).astype(dtype)


def likely_bug(got: np.ndarray, x: np.ndarray, parts, exact: np.ndarray, group_size, bits, tol):
    """What a wrong answer matches, said as the slip that gives it (or a generic hint)."""
    codes = np.array(parts[0])
    scales, biases = (np.array(a.astype(mx.float32), dtype=np.float64) for a in parts[1:])
    words = codes.astype(np.uint64)
    shifts = np.arange(0, 32, bits, dtype=np.uint64)
    top = np.uint64((1 << bits) - 1)
    q = ((words[..., None] >> shifts) & top).reshape(codes.shape[0], -1).astype(np.float64)
    q_reversed = ((words[..., None] >> shifts[::-1]) & top).reshape(q.shape).astype(np.float64)
    s = np.repeat(scales, group_size, axis=1)
    b = np.repeat(biases, group_size, axis=1)
    n = got.shape[-1]
    candidates = {
        "the codes read from the highest bits first: the first code of a word sits in its lowest "
        "bits": x @ (s * q_reversed + b).T,
        "the bias left out (w = scale * code + bias)": x @ (s * q).T,
        "the bias multiplied by the code (w = scale * code + bias, not (scale + bias) * code)": x
        @ ((s + b) * q).T,
        "every row using the first row's scales and biases: row n's groups start at "
        "n * (K / group_size)": x @ (s[:1] * q + b[:1]).T,
    }
    for slip, wrong in candidates.items():
        if np.abs(got - wrong).max() <= tol:
            return slip
    bad_rows = np.flatnonzero(np.abs(got - exact).max(axis=0) > tol)
    if len(bad_rows) and bad_rows.min() >= n - 15 and n - bad_rows.min() == len(bad_rows):
        return (
            f"only the last {len(bad_rows)} output rows are wrong: the rows after the last full "
            "block of R rows are left out (the loop over single rows)"
        )
    return f"output rows {bad_rows[:8].tolist()} of {n} differ"


def check_kernel(impl, rows, cols, m, group_size, bits, dtype, fast, seed=0):
    parts, w = quantized(rows, cols, group_size, bits, dtype, seed)
    x = x_rows(m, cols, dtype, seed)
    got = impl.quantized_matvec(x, *parts, group_size=group_size, bits=bits, fast=fast)
    assert got.shape == (m, rows), f"the output is {got.shape}, not [M, N] = {(m, rows)}"
    assert got.dtype == dtype, f"the output is {got.dtype}: it keeps x's dtype, {dtype}"
    got = np.array(got.astype(mx.float32), dtype=np.float64)
    xs = np.array(x.astype(mx.float32), dtype=np.float64)
    if dtype == mx.float32:  # MLX's own kernel, same codes
        want = np.array(
            mx.quantized_matmul(x, *parts, transpose=True, group_size=group_size, bits=bits)
        )
    else:
        want = xs @ w.T
    tol = kernel_tolerance(dtype, want)
    err = np.abs(got - want).max()
    if err > tol:
        hint = likely_bug(got, xs, parts, xs @ w.T, group_size, bits, tol)
        pytest.fail(
            f"{'fast' if fast else 'plain'} kernel, W [{rows}, {cols}] at {bits} bits, group "
            f"{group_size}, {dtype}, {m} row(s) of x: off by {err:.3g} (tolerance {tol:.2g}); "
            f"looks like {hint}"
        )


# --- Task 1: the plain loop ---------------------------------------------------------------------


@pytest.mark.parametrize("group_size,bits", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_loop_matches_mlx(impl, group_size, bits, dtype):
    check_kernel(impl, 37, 256, 1, group_size, bits, DTYPES[dtype], fast=False)


def test_plain_loop_takes_every_row_of_x(impl):
    """x [2, 3, K]: every row gets its own product, in x's shape with the last axis N."""
    parts, w = quantized(24, 128, 64, 4, mx.float32, 1)
    x = x_rows(6, 128, mx.float32, 1).reshape(2, 3, 128)
    got = impl.quantized_matvec(x, *parts, group_size=64, bits=4, fast=False)
    assert got.shape == (2, 3, 24), f"x [2, 3, 128] gives {got.shape}, not [2, 3, 24]"
    want = np.array(x).reshape(6, 128) @ w.T
    assert np.abs(np.array(got).reshape(6, 24) - want).max() < 1e-3, (
        "the rows of x after the first are wrong: row m of x starts at m * K, of y at m * N"
    )


# --- Tasks 2 and 3: the fast kernel ---------------------------------------------------------------


@pytest.mark.parametrize("group_size,bits", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_kernel_matches_mlx(impl, group_size, bits, dtype):
    """37 rows: whole blocks of R rows and some left over, for any R up to 32 but 37."""
    check_kernel(impl, 37, 256, 1, group_size, bits, DTYPES[dtype], fast=True)


@pytest.mark.parametrize("rows", [1, 3, 8, 1029, 8197])
def test_fast_kernel_on_ragged_and_threaded_shapes(impl, rows):
    """Fewer rows than a block, one block of eight, and 1029 and 8197 rows of 1024 (8197:
    enough work for a thread per core, the last range ragged)."""
    check_kernel(impl, rows, 1024, 1, 64, 4, mx.float32, fast=True, seed=rows)


def test_fast_kernel_takes_every_row_of_x(impl):
    check_kernel(impl, 40, 128, 5, 32, 4, mx.float32, fast=True, seed=7)


def test_fast_equals_plain(impl):
    """Same sum, other order: the two kernels agree to float32 rounding on a large product."""
    parts, _ = quantized(515, 2048, 128, 4, mx.float32, 3)
    x = x_rows(1, 2048, mx.float32, 3)
    plain = impl.quantized_matvec(x, *parts, group_size=128, bits=4, fast=False)
    fast = impl.quantized_matvec(x, *parts, group_size=128, bits=4, fast=True)
    assert_close(fast, plain, "fast kernel against the plain loop", atol=1e-3, rtol=1e-4)


def test_inputs_need_not_be_contiguous(impl):
    """A transposed x and a sliced weight: the op hands the kernel contiguous copies."""
    parts, w = quantized(64, 128, 64, 4, mx.float32, 5)
    x = x_rows(128, 2, mx.float32, 5).T  # [2, 128], column-major
    codes, scales, biases = (a[::2] for a in parts)  # every other weight row
    got = impl.quantized_matvec(x, codes, scales, biases, group_size=64, bits=4, fast=True)
    want = np.array(x) @ w[::2].T
    assert np.abs(np.array(got) - want).max() < 1e-3, "strided inputs give another answer"


# --- Task 4: the model with its codes packed ------------------------------------------------------


@pytest.fixture(scope="module", params=[4, 8])
def packed_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-q{request.param}-own")
    return load_checkpoint(make_tiny_checkpoint(path, seed=0, quantize=request.param))


def test_small_passes_go_through_the_kernel(impl, packed_ckpt, monkeypatch):
    """A pass of one row goes through quantized_matvec, one of more than OWN_KERNEL_MAX_ROWS
    rows does not; both equal the float product of the dequantized weight."""
    model = impl.Qwen3Model(packed_ckpt, quantized_linear="own-kernel")
    weight = model.lm_head
    assert isinstance(weight, impl.QuantizedWeight) and weight.own_kernel, (
        "quantized_linear='own-kernel' keeps each quantized layer a QuantizedWeight with "
        "own_kernel=True (layer_weights)"
    )
    module = __import__(f"{impl.__name__}.quantize", fromlist=["quantize"])
    calls = []
    real = module.quantized_matvec
    monkeypatch.setattr(
        module, "quantized_matvec", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    )
    dense = weight.dequantize()
    for rows in (1, impl.OWN_KERNEL_MAX_ROWS, impl.OWN_KERNEL_MAX_ROWS + 1):
        calls.clear()
        x = x_rows(rows, dense.shape[1], mx.float32, rows)[None]  # [1, rows, I]
        got = weight.linear(x)
        assert_close(got, x @ dense.T, f"a pass of {rows} rows through own_kernel_linear")
        small = rows <= impl.OWN_KERNEL_MAX_ROWS
        assert bool(calls) == small, (
            f"a pass of {rows} rows {'did not go' if small else 'went'} through quantized_matvec"
            f": passes of up to OWN_KERNEL_MAX_ROWS ({impl.OWN_KERNEL_MAX_ROWS}) rows use the "
            "kernel, larger ones dequantize the weight for the call"
        )


def test_model_with_own_kernel_equals_model_without(impl, packed_ckpt):
    """Prefill and decode steps: logits within 1e-4 of the dequantize-at-load model and of
    MLX's kernel; the greedy tokens are the same."""
    ours = impl.Qwen3Model(packed_ckpt, quantized_linear="own-kernel")
    for other in ("dequantize-at-load", "kernel"):
        theirs = impl.Qwen3Model(packed_ckpt, quantized_linear=other)
        tokens = mx.array([[5, 17, 300, 42, 9, 100, 7, 8, 640, 2]])
        a, b = ours.create_kv_cache(), theirs.create_kv_cache()
        assert_close(ours(tokens, 0, a), theirs(tokens, 0, b), f"prefill logits vs {other}")
        for i, token in enumerate([11, 12, 13]):
            step = mx.array([[token]])
            offset = tokens.shape[1] + i
            assert_close(ours(step, offset, a), theirs(step, offset, b), f"decode {i} vs {other}")
    prompt = list(range(3, 12))
    want = list(impl.simple_generate_with_kv_cache(theirs, prompt, 16))
    got = list(impl.simple_generate_with_kv_cache(ours, prompt, 16))
    assert got == want, "greedy tokens with the own kernel differ from MLX's kernel's"

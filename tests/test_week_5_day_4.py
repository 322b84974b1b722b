"""Week 5 Day 4: decode at the weights' bandwidth, a few-row matmul under every linear layer.

Task 1  plain (csrc/few_row_matmul.cpp): the plain loop, every row of x against every weight
        row, for float weights and Day 1's packed format alike (the weight readers are given).
Task 2  tile: R weight rows against MB rows of x, eight columns per vector operation, the R x MB
        sums in registers, the last K % 8 columns one at a time.
Task 3  tiled: x once as floats, then blocks of R weight rows over the cores, every row of x
        in tiles of four and the rest.
Task 4  FewRowWeight.linear (few_row.py): passes of at most FEW_ROW_MAX_ROWS rows through the
        kernel, larger ones through MLX's matmul (Qwen3Model(linear_kernel="few-row")).

Oracles: MLX's matmul (x @ w.T) and mx.quantized_matmul on the same weights (float32), the
float64 product of the same half-precision weights, and the model and engine without the kernel
(logits, greedy tokens; dense caches and pages, both policies, speculation, a quantized model).
"""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_close, kernel_tolerance, prompt_with_tokens, serve_greedy

from tiny_llm_support import load_checkpoint, make_tiny_checkpoint

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
FORMATS = [(g, b) for b in (2, 4, 8) for g in (32, 64, 128)]  # (group_size, bits)


def random(shape, seed: int, dtype=mx.float32) -> mx.array:
    a = np.random.RandomState(seed).standard_normal(shape).astype(np.float32)
    return mx.array(a).astype(dtype)


def as64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def likely_bug(got: np.ndarray, x: np.ndarray, w: np.ndarray, tol: float) -> str:
    """The slip a wrong y [M, N] looks like, from x [M, K] and the weight's values w [N, K]."""
    m, k = x.shape
    cut = k // 8 * 8
    candidates = {
        f"the last K % 8 = {k - cut} columns left out (the tail after the last block of eight)": x[
            :, :cut
        ]
        @ w[:, :cut].T,
        "every row of x given row 0's product: row m of x starts at m * K": np.repeat(
            x[:1] @ w.T, m, axis=0
        ),
        "x and w swapped (y is [M, N] = x @ w.T, y[m, n] at m * N + n)": (x @ w.T)
        .T.reshape(-1)[: got.size]
        .reshape(got.shape),
    }
    for slip, wrong in candidates.items():
        if wrong.shape == got.shape and np.abs(got - wrong).max() <= tol:
            return slip
    bad = np.abs(got - x @ w.T) > tol
    rows, cols = np.flatnonzero(bad.any(axis=1)), np.flatnonzero(bad.any(axis=0))
    left = m % 4
    if left and rows.tolist() == list(range(m - left, m)):
        return (
            f"only the {left} row(s) of x after the last full tile of four are wrong (of {m}): "
            f"against_all_rows' switch hands them to tile<R, {left}>"
        )
    if len(rows) and rows.min() > 0:
        return (
            f"row 0 of x is right and rows {rows[:8].tolist()} are not: a tile reads row m0 + m "
            "of x at xf + (m0 + m) * ldx and writes y at (m0 + m) * N"
        )
    n = got.shape[1]
    if len(cols) < n and cols.min() == n - len(cols):
        return (
            f"only the last {len(cols)} of {n} weight rows are wrong: the rows after the last "
            "full block of R (one row at a time) are left out"
        )
    return f"rows of x {rows[:8].tolist()} and weight rows {cols[:8].tolist()} differ"


def check(impl, m: int, n: int, k: int, dtype, fast: bool, seed: int = 0) -> None:
    """few_row_matmul on x [m, k] and w [n, k] against MLX's matmul (float32) or the float64
    product of the same half-precision values."""
    x, w = random((m, k), seed, dtype), random((n, k), seed + 1, dtype)
    got = impl.few_row_matmul(x, w, fast=fast)
    mx.eval(got)  # before the oracle: an output a kernel leaves unwritten must not hold its answer
    assert got.shape == (m, n), f"the output is {got.shape}, not [M, N] = {(m, n)}"
    assert got.dtype == dtype, f"the output is {got.dtype}: it keeps x's dtype, {dtype}"
    xs, ws = as64(x), as64(w)
    want = as64(x @ w.T) if dtype == mx.float32 else xs @ ws.T
    tol = kernel_tolerance(dtype, want)
    err = np.abs(as64(got) - want).max()
    if err > tol:
        pytest.fail(
            f"{'tiled' if fast else 'plain'} kernel, x [{m}, {k}] @ w [{n}, {k}].T in {dtype}: "
            f"off by {err:.3g} (tolerance {tol:.2g}); looks like "
            f"{likely_bug(as64(got), xs, ws, tol)}"
        )


def check_packed(impl, m: int, n: int, k: int, group_size: int, bits: int, fast: bool, seed=0):
    """few_row_quantized_matmul against mx.quantized_matmul on the same codes."""
    x = random((m, k), seed)
    parts = mx.quantize(random((n, k), seed + 1), group_size=group_size, bits=bits)
    got = impl.few_row_quantized_matmul(x, *parts, group_size=group_size, bits=bits, fast=fast)
    mx.eval(got)
    want = mx.quantized_matmul(x, *parts, transpose=True, group_size=group_size, bits=bits)
    w = as64(mx.dequantize(*parts, group_size=group_size, bits=bits))
    tol = kernel_tolerance(mx.float32, as64(want))
    err = np.abs(as64(got) - as64(want)).max() if got.shape == want.shape else np.inf
    if err > tol:
        hint = likely_bug(as64(got), as64(x), w, tol) if got.shape == want.shape else "a shape"
        pytest.fail(
            f"{'tiled' if fast else 'plain'} kernel on packed weights [{n}, {k}] at {bits} bits, "
            f"groups of {group_size}, {m} row(s) of x: off by {err:.3g} (tolerance {tol:.2g}); "
            f"looks like {hint}"
        )


# --- Task 1: the plain loop --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_plain_loop_matches_mlx(impl, m, dtype):
    """37 weight rows of K = 35: no size a multiple of a block."""
    check(impl, m, 37, 35, DTYPES[dtype], fast=False, seed=m)


@pytest.mark.parametrize("group_size,bits", FORMATS)
def test_plain_loop_on_packed_weights(impl, group_size, bits):
    check_packed(impl, 3, 37, 256, group_size, bits, fast=False)


# --- Tasks 2 and 3: the tiled kernel -----------------------------------------------------------


@pytest.mark.parametrize("m", range(1, 17))
def test_tiled_kernel_for_every_row_count(impl, m):
    """1 to 16 rows of x: whole tiles of four and each remainder; 37 weight rows, K = 131."""
    check(impl, m, 37, 131, mx.float32, fast=True, seed=m)


@pytest.mark.parametrize("k", [8, 35, 1024])
def test_tiled_kernel_on_ragged_k(impl, k):
    check(impl, 5, 19, k, mx.float32, fast=True, seed=k)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", [1, 6])
def test_tiled_kernel_in_half_types(impl, m, dtype):
    check(impl, m, 45, 200, DTYPES[dtype], fast=True, seed=m)


@pytest.mark.parametrize("m", [1, 8])
def test_tiled_kernel_large_enough_for_threads(impl, m):
    """8197 weight rows of 1024: enough work for a thread per core, the last range ragged."""
    check(impl, m, 8197, 1024, mx.float32, fast=True, seed=m)


@pytest.mark.parametrize("group_size,bits", FORMATS)
@pytest.mark.parametrize("m", [1, 7])
def test_tiled_kernel_on_packed_weights(impl, m, group_size, bits):
    check_packed(impl, m, 37, 256, group_size, bits, fast=True, seed=m)


def test_tiled_equals_plain(impl):
    """Same sums, other order: the two kernels agree to float32 rounding on a large product."""
    x, w = random((9, 2048), 3), random((515, 2048), 4)
    plain = impl.few_row_matmul(x, w, fast=False)
    assert_close(impl.few_row_matmul(x, w, fast=True), plain, "tiled against plain", 1e-3)


def test_every_leading_shape_and_strided_inputs(impl):
    """x [2, 3, K] gives [2, 3, N]; a transposed x and every other weight row: the op hands the
    kernel contiguous copies."""
    x, w = random((128, 6), 5).T.reshape(2, 3, 128), random((64, 128), 6)[::2]
    got = impl.few_row_matmul(x, w)
    assert got.shape == (2, 3, 32), f"x [2, 3, 128] gives {got.shape}, not [2, 3, 32]"
    assert_close(got, x @ w.T, "strided inputs and leading dimensions")


# --- Task 4: every linear layer of the model -----------------------------------------------------


def kernel_calls(impl, monkeypatch) -> list:
    """The row counts of the passes FewRowWeight.linear sends to either kernel."""
    module = importlib.import_module(f"{impl.__name__}.few_row")
    calls = []
    for name in ("few_row_matmul", "few_row_quantized_matmul"):
        real = getattr(module, name)
        spy = lambda *a, real=real, name=name, **k: (
            calls.append((name, a[0].shape)) or real(*a, **k)
        )
        monkeypatch.setattr(module, name, spy)
    return calls


def test_small_passes_go_through_the_kernel(impl, monkeypatch):
    calls = kernel_calls(impl, monkeypatch)
    w = random((24, 64), 7)
    weight = impl.FewRowWeight(w)
    for rows in (1, impl.FEW_ROW_MAX_ROWS, impl.FEW_ROW_MAX_ROWS + 1):
        calls.clear()
        x = random((1, rows, 64), rows)
        assert_close(weight.linear(x), x @ w.T, f"a pass of {rows} rows")
        small = rows <= impl.FEW_ROW_MAX_ROWS
        assert bool(calls) == small, (
            f"a pass of {rows} rows {'did not go' if small else 'went'} through few_row_matmul: "
            f"passes of up to FEW_ROW_MAX_ROWS ({impl.FEW_ROW_MAX_ROWS}) rows use the kernel, "
            "larger ones MLX's matmul"
        )


def test_quantized_weights_go_through_the_packed_kernel(impl, monkeypatch):
    calls = kernel_calls(impl, monkeypatch)
    w = random((24, 64), 8)
    parts = mx.quantize(w, group_size=32, bits=4)
    weight = impl.FewRowWeight(impl.QuantizedWeight(*parts, group_size=32, bits=4))
    x = random((2, 64), 9)
    want = mx.quantized_matmul(x, *parts, transpose=True, group_size=32, bits=4)
    assert_close(weight.linear(x), want, "a quantized weight's small pass")
    assert [name for name, _ in calls] == ["few_row_quantized_matmul"], (
        f"calls made: {calls}: a QuantizedWeight's codes go to few_row_quantized_matmul, packed"
    )


def compare_models(impl, ours, theirs, what: str) -> None:
    """Prefill of 17 tokens (a pass too large for the kernel), three decode steps, 16 greedy
    tokens."""
    tokens = mx.array([[5, 17, 300, 42, 9, 100, 7, 8, 640, 2, 33, 71, 12, 90, 4, 6, 61]])
    a, b = ours.create_kv_cache(), theirs.create_kv_cache()
    assert_close(ours(tokens, 0, a), theirs(tokens, 0, b), f"{what}: prefill logits")
    for i, token in enumerate([11, 12, 13]):
        step, offset = mx.array([[token]]), tokens.shape[1] + i
        assert_close(ours(step, offset, a), theirs(step, offset, b), f"{what}: decode step {i}")
    prompt = list(range(3, 12))
    want = list(impl.simple_generate_with_kv_cache(theirs, prompt, 16))
    got = list(impl.simple_generate_with_kv_cache(ours, prompt, 16))
    assert got == want, f"{what}: other greedy tokens"


def test_model_with_kernel_equals_model_without(impl, tiny_ckpt, monkeypatch):
    """Tied and untied heads: the logits of MLX's matmul (1e-4), the same greedy tokens; every
    linear layer and the head of a decode step go through the kernel."""
    calls = kernel_calls(impl, monkeypatch)
    ours = impl.Qwen3Model(tiny_ckpt, linear_kernel="few-row")
    assert ours.linear_kernel == "few-row"
    compare_models(impl, ours, impl.Qwen3Model(tiny_ckpt), "few-row against MLX's matmul")
    per_step = 7 * tiny_ckpt.config.num_hidden_layers + 1  # q k v o gate up down, the head
    assert len(calls) >= 3 * per_step, (
        f"{len(calls)} kernel calls for 3 decode steps: each step has {per_step} linear layers "
        "(use_few_row_kernel wraps them; FewRowWeight.linear sends one-row passes to the kernel)"
    )


@pytest.fixture(scope="module")
def packed_ckpt(tmp_path_factory):
    return load_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp("q4"), quantize=4))


def test_quantized_model_with_kernel_equals_mlx_kernel(impl, packed_ckpt):
    ours = impl.Qwen3Model(packed_ckpt, quantized_linear="own-kernel", linear_kernel="few-row")
    theirs = impl.Qwen3Model(packed_ckpt, quantized_linear="kernel")
    compare_models(impl, ours, theirs, "4-bit few-row against mx.quantized_matmul")


LENGTHS = (10, 12, 9, 14, 11, 8)


@pytest.mark.parametrize("pages", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_engine_with_kernel_generates_the_tokens_without(impl, tiny_gqa_ckpt, tokenizer, policy,
                                                         pages):  # fmt: skip
    """Batched decode (alternate) and ragged passes (hybrid), dense caches and pages read in
    place: the greedy tokens of the same engine with MLX's matmul."""
    prompts = [tokenizer.encode(prompt_with_tokens(tokenizer, n)) for n in LENGTHS]
    settings = dict(max_seq_len=64, batch_size=4, prefill_step=8, policy=policy)
    runs = {}
    for kernel in ("mlx", "few-row"):
        model = impl.Qwen3Model(tiny_gqa_ckpt, linear_kernel=kernel)
        pools = model.create_kv_pools(page_size=4, read_in_place=True) if pages else None
        runs[kernel] = serve_greedy(impl.Engine(model, tokenizer, pools=pools, **settings),
                                    prompts, 12)  # fmt: skip
    assert runs["few-row"] == runs["mlx"], (
        f"{policy}, {'paged' if pages else 'dense'}: with the few-row kernel the engine "
        "generated other tokens than with MLX's matmul"
    )


def test_speculation_with_kernel_generates_the_plain_tokens(impl, tiny_gqa_ckpt, tokenizer):
    """Prompt lookup: verify passes of a few rows each go through the kernel too."""
    base = tokenizer.encode(prompt_with_tokens(tokenizer, 9))
    prompts = [base * 3, base + base[:4], tokenizer.encode(prompt_with_tokens(tokenizer, 14))]
    settings = dict(max_seq_len=96, batch_size=3, prefill_step=16, policy="hybrid")
    plain = serve_greedy(impl.Engine(impl.Qwen3Model(tiny_gqa_ckpt), tokenizer, **settings),
                         prompts, 14)  # fmt: skip
    model = impl.Qwen3Model(tiny_gqa_ckpt, linear_kernel="few-row")
    engine = impl.Engine(model, tokenizer, speculative=impl.PromptLookup(2), **settings)
    got = serve_greedy(engine, prompts, 14)
    assert got == plain, "speculation with the kernel generated other tokens than plain decoding"

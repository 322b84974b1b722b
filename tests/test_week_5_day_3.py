"""Week 5 Day 3: the experts' matmul of a mixture of experts, rows grouped by expert, in C++.

Task 1  grouped_plain (csrc/grouped_matmul.cpp): the plain loop, each row against the weight
        rows of its expert, one dot product at a time.
Task 2  tile: R rows of one run x C weight rows of its expert at once, eight values of K per
        vector operation, the last K % 8 one at a time.
Task 3  grouped_fast: the runs of rows sharing an expert, the weight rows over the cores.
Task 4  OwnKernelExperts.gather_linear (moe.py): 4.6's grouped pairs through the kernel
        (Qwen3Model(expert_matmul="own-kernel")).

Oracles: mx.gather_mm with sorted indices, a loop of plain MLX matmuls, one per expert (float32),
the product in float64 (float16 and bfloat16), and the block and model on mx.gather_mm's path
(logits, greedy tokens).
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_close, kernel_tolerance

from tiny_llm_support import load_checkpoint, make_tiny_moe_checkpoint, quantize_checkpoint

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
KERNELS = {"plain": False, "fast": True}

# name -> (experts of the rows, sorted; E; N; K)
CASES = {
    "experts 1 and 3 get no rows": ([0] * 3 + [2] * 7 + [4], 5, 21, 40),
    "one expert takes every row": ([2] * 37, 4, 19, 64),
    "runs of one row each": (list(range(9)), 9, 16, 24),
    "runs not a multiple of the tile, N and K not of the block": (
        [0] * 13 + [1] * 29 + [3] * 6 + [5] * 2,
        6,
        37,
        83,
    ),
    "square weights (N == K)": ([1] * 5 + [2] * 11, 3, 48, 48),
    "one row": ([3], 4, 7, 5),
}


def problem(experts, E, N, K, dtype=mx.float32, seed=0):
    rng = np.random.RandomState(seed)
    x = mx.array(rng.standard_normal((len(experts), K)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32)).astype(dtype)
    return x, w, mx.array(experts, dtype=mx.int32)


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def exact(x, w, experts) -> np.ndarray:
    """y[i] = x[i] @ w[experts[i]].T in float64."""
    xs, ws, ids = f64(x), f64(w), np.array(experts)
    return np.einsum("mk,mnk->mn", xs, ws[ids])


def likely_bug(got: np.ndarray, x, w, experts, tol) -> str:
    """What a wrong answer matches, said as the slip that gives it (or which rows and columns)."""
    xs, ws, ids = f64(x), f64(w), np.array(experts)
    M, N, K = got.shape[0], ws.shape[1], ws.shape[2]
    want = exact(x, w, experts)
    if N == K and np.abs(got - np.einsum("mk,mkn->mn", xs, ws[ids])).max() <= tol:
        return "the transposed weight: y[i, n] sums x[i, k] * w[e, n, k] over k (w is [E, N, K])"
    k8 = K // 8 * 8
    if (
        0 < k8 < K
        and np.abs(got - np.einsum("mk,mnk->mn", xs[:, :k8], ws[ids][..., :k8])).max() <= tol
    ):
        return f"the last K % 8 = {K - k8} values of K left out (the tail after the last vector)"
    if np.abs(got - xs @ ws[ids[0]].T).max() <= tol and len(set(ids)) > 1:
        return "every row multiplied by the first row's expert: a new run starts where the expert changes"
    bad = ~(np.abs(got - want) <= tol)  # [M, N], NaN (memory never written) counted
    rows, cols = np.flatnonzero(bad.any(axis=1)), np.flatnonzero(bad.any(axis=0))
    ends = [i for i in range(M) if i == M - 1 or ids[i + 1] != ids[i]]
    if len(cols) < N and len(cols) and cols.min() >= N - 15 and N - cols.min() == len(cols):
        return (
            f"only the last {len(cols)} output columns are wrong: the weight rows left over after "
            "the last full tile of C weight rows are dropped"
        )
    if 0 < len(cols) < N:
        return (
            f"output columns {cols.min()}..{cols.max()} of {N} are wrong: a core's range of weight "
            "rows [begin, end) is skipped or misplaced"
        )
    for i in rows:
        nxt = ids[i + 1] if i + 1 < M else None
        if nxt is not None and nxt != ids[i] and np.abs(got[i] - xs[i] @ ws[nxt].T).max() <= tol:
            return (
                f"row {i}, the last of expert {ids[i]}'s run, multiplied by the next expert's "
                f"({nxt}) weights: run j is rows [starts[j], starts[j + 1]), all with the expert "
                "of its first row, experts[starts[j]]"
            )
    if len(rows) and set(rows) <= set(i for e in ends for i in range(e - 7, e + 1)):
        return (
            f"only rows {rows[:8].tolist()} at the ends of runs are wrong: the rows left over after "
            "a run's last full tile of R rows are dropped (the loop over single rows)"
        )
    return f"rows {rows[:8].tolist()} of {M} differ (experts {ids[rows[:8]].tolist()})"


def poison(shape, dtype) -> None:
    """Leave a freed buffer of NaNs in MLX's cache: the next output of this size gets it, so
    an output element the kernel never writes reads NaN, not a stale right answer."""
    mx.eval(mx.full(shape, float("nan"), dtype=dtype))


def check(impl, x, w, experts, fast, what, oracles=True):
    M, N = x.shape[0], w.shape[1]
    poison((M, N), x.dtype)
    got = impl.grouped_matmul(x, w, experts, fast=fast)
    mx.eval(got)  # now, before an oracle frees a buffer of the same size
    kernel = "fast kernel" if fast else "plain loop"
    assert got.shape == (M, N), f"{kernel}: the output is {got.shape}, not [M, N] = {(M, N)}"
    assert got.dtype == x.dtype, f"{kernel}: the output is {got.dtype}, not x's {x.dtype}"
    want = exact(x, w, experts)
    wants = {"the product in float64": want}
    if oracles and x.dtype == mx.float32:
        wants["mx.gather_mm"] = np.array(
            mx.gather_mm(x[:, None], w.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)
        )[:, 0]
        ids = np.array(experts)
        loop = np.zeros((M, N), dtype=np.float32)
        for e in np.unique(ids):
            rows = np.flatnonzero(ids == e)
            loop[rows] = np.array(x[mx.array(rows)] @ w[int(e)].T)
        wants["a plain matmul per expert"] = loop
    tol = kernel_tolerance(x.dtype, want)
    g = f64(got)
    for oracle, value in wants.items():
        err = np.abs(g - value).max()
        if not err <= tol:  # NaN fails too
            pytest.fail(
                f"{kernel}, {what} (x [{M}, {x.shape[1]}], w {list(w.shape)}, {x.dtype}): off "
                f"by {err:.3g} from {oracle} (tolerance {tol:.2g}); looks like "
                f"{likely_bug(g, x, w, experts, tol)}"
            )


# --- Tasks 1 to 3: the plain loop and the fast kernel on ragged shapes --------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_matches_gather_mm_and_a_loop_of_matmuls(impl, kernel, case):
    experts, E, N, K = CASES[case]
    x, w, ids = problem(experts, E, N, K, seed=len(experts))
    check(impl, x, w, ids, KERNELS[kernel], case)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_types_accumulate_in_float32(impl, kernel, dtype):
    experts, E, N, K = CASES["runs not a multiple of the tile, N and K not of the block"]
    x, w, ids = problem(experts, E, N, K, DTYPES[dtype], seed=5)
    check(impl, x, w, ids, KERNELS[kernel], f"{dtype}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_unsorted_experts_are_still_right(impl, kernel):
    """Sorted is what makes it fast; any order is still correct (a new run wherever the expert
    changes, not one run per expert)."""
    experts = [3, 3, 0, 0, 0, 3, 1, 1, 1, 1, 1, 0, 2]
    x, w, ids = problem(experts, 4, 13, 35, seed=2)
    check(impl, x, w, ids, KERNELS[kernel], "unsorted experts", oracles=False)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_whose_expert_is_out_of_range_is_nan(impl, kernel):
    """Expert ids outside [0, E) are never read from: that row is NaN, the others are right."""
    x, w, ids = problem([0, 1, 1, 7, -1], 3, 9, 16, seed=4)
    got = np.array(impl.grouped_matmul(x, w, ids, fast=KERNELS[kernel]))
    assert np.isnan(got[3:]).all(), "rows with expert 7 and -1 of E = 3 must come out NaN"
    want = exact(x[:3], w, ids[:3])
    assert np.abs(got[:3] - want).max() < 1e-4, "the rows with a valid expert are wrong"


def test_fast_on_large_threaded_shapes(impl):
    """Enough work for a thread per core: 4.6's pairs of a small prefill, 32 experts, ragged
    runs, N = 257 and K = 515 (the last range of weight rows ragged)."""
    rng = np.random.RandomState(9)
    experts = np.sort(rng.randint(0, 32, 300)).tolist()
    x, w, ids = problem(experts, 32, 257, 515, seed=9)
    check(impl, x, w, ids, True, "300 rows over 32 experts")


def test_fast_equals_plain(impl):
    experts = [0] * 17 + [1] * 3 + [4] * 40
    x, w, ids = problem(experts, 5, 130, 300, seed=6)
    fast = impl.grouped_matmul(x, w, ids, fast=True)
    plain = impl.grouped_matmul(x, w, ids, fast=False)
    assert_close(fast, plain, "fast kernel against the plain loop", atol=1e-3, rtol=1e-4)


def test_inputs_need_not_be_contiguous(impl):
    """A transposed x and every other expert of a stack: the op hands the kernel copies."""
    x, w, ids = problem([0, 0, 1, 2, 2, 2], 6, 12, 20, seed=8)
    xt = mx.array(np.array(x).T.copy()).T  # [6, 20], column-major
    got = impl.grouped_matmul(xt, w[::2], ids, fast=True)
    want = exact(x, w[::2], ids)
    assert np.abs(np.array(got) - want).max() < 1e-4, "strided inputs give another answer"


# --- Task 4: the mixture of experts with the kernel --------------------------------------------


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """Every layer sparse: 2 of 8 experts per token."""
    return load_checkpoint(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe53"), seed=3))


def test_the_block_with_the_kernel_equals_gather_mm(impl, moe_ckpt, monkeypatch):
    """One sparse block, grouped, on gather_mm's path and on the kernel's: a prefill of 23
    tokens and a decode step of 3 rows; the kernel is called for each projection."""
    theirs = impl.Qwen3Model(moe_ckpt).layers[0].mlp
    ours = impl.Qwen3Model(moe_ckpt, expert_matmul="own-kernel").layers[0].mlp
    assert isinstance(ours.w_gate, impl.OwnKernelExperts), (
        "expert_matmul='own-kernel' wraps each float stack in OwnKernelExperts "
        "(Qwen3SparseMoE.set_expert_matmul)"
    )
    module = __import__(f"{impl.__name__}.moe", fromlist=["moe"])
    calls, real = [], module.grouped_matmul
    monkeypatch.setattr(module, "grouped_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    theirs.grouped = True
    for shape in ((1, 23), (3, 1)):
        x = mx.random.normal((*shape, moe_ckpt.config.hidden_size), key=mx.random.key(shape[1]))
        calls.clear()
        assert_close(ours(x), theirs(x), f"the block on x {list(x.shape)}")
        assert len(calls) == 3, (
            f"grouped_matmul called {len(calls)} times for a block: once per projection (gate, "
            "up, down), through gather_linear"
        )


def test_the_model_with_the_kernel_equals_the_model_without(impl, moe_ckpt):
    """Prefill and decode: logits within 1e-4 of gather_mm's and of the loop's; the same greedy
    tokens; a quantized stack keeps MLX's gather_qmm."""
    ours = impl.Qwen3Model(moe_ckpt, expert_matmul="own-kernel")
    for grouped in (True, False):
        theirs = impl.Qwen3Model(moe_ckpt)
        for layer in theirs.layers:
            layer.mlp.grouped = grouped
        tokens = mx.array([[5, 17, 300, 42, 9, 100, 7, 8, 640, 2]])
        a, b = ours.create_kv_cache(), theirs.create_kv_cache()
        path = "gather_mm" if grouped else "the loop"
        assert_close(ours(tokens, 0, a), theirs(tokens, 0, b), f"prefill logits vs {path}")
        for i, token in enumerate([11, 12, 13]):
            step, offset = mx.array([[token]]), tokens.shape[1] + i
            assert_close(ours(step, offset, a), theirs(step, offset, b), f"decode {i} vs {path}")
    prompt = list(range(3, 12))
    want = list(impl.simple_generate_with_kv_cache(theirs, prompt, 12))
    got = list(impl.simple_generate_with_kv_cache(ours, prompt, 12))
    assert got == want, "greedy tokens with the kernel differ from the model's without it"
    quantized = impl.Qwen3Model(
        quantize_checkpoint(moe_ckpt, bits=4), quantized_linear="kernel", expert_matmul="own-kernel"
    )
    assert isinstance(quantized.layers[0].mlp.w_gate, impl.QuantizedWeight), (
        "a quantized expert stack keeps MLX's gather_qmm: only float stacks use the kernel"
    )

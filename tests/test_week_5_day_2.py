"""Week 5 Day 2: fused paged decode attention, a C++ kernel that walks page tables in place.

Task 1  decode_plain (csrc/paged_attention.cpp): every position of one query head, an online
        softmax in float32, the KV head of the query's group.
Task 2  decode_group: one (row, KV head) with its whole GQA group, a page at a time, eight lanes
        of the head dim per operation.
Task 3  decode_fast: every (row, KV head) pair, the pairs shared among the cores when the work
        is large.
Task 4  own_decode_attention (paged_decode.py): decode rows of paged_attention through the
        kernel, opt-in per pool (use_own_decode_kernel).

Oracles: MLX's mx.fast.scaled_dot_product_attention over the pages gathered with numpy, the
Week 3 Day 5 paged_attention over the same pool, and the model and engine without the kernel
(logits, greedy tokens; dense caches and paged ones, both scheduling policies, speculation).
"""

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_close, kernel_tolerance, prompt_with_tokens, serve_greedy

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
JUNK = 100.0  # every value slot no row may read: past a row's length, padding, unused pages


class Case:
    """A pool [num_pages, H_kv, P, D] whose pages are handed out in shuffled order, one query per
    row, padded page tables and ragged lengths. Slots a row must not read hold values of JUNK."""

    def __init__(self, lengths, h_q, h_kv, d, page, dtype=mx.float32, seed=0):
        rng = np.random.RandomState(seed)
        self.lengths, self.h_q, self.h_kv, self.d, self.page = list(lengths), h_q, h_kv, d, page
        per_row = [-(-n // page) for n in lengths]
        width = max(per_row) + 1  # every table has at least one padding entry
        num_pages = sum(per_row) + 2
        ids = rng.permutation(num_pages).tolist()
        self.tables, used = [], 0
        for n in per_row:
            self.tables.append(ids[used : used + n])
            used += n
        junk_page = ids[-1]  # a page no row owns: the padding points at it
        self.padded = [t + [junk_page] * (width - len(t)) for t in self.tables]
        keys = rng.standard_normal((num_pages, h_kv, page, d)).astype(np.float32)
        values = rng.standard_normal((num_pages, h_kv, page, d)).astype(np.float32)
        for table, n in zip(self.tables, lengths):
            last = table[-1]
            values[last, :, n - (len(table) - 1) * page :] = JUNK  # past the row's length
        values[ids[used:]] = JUNK
        q = rng.standard_normal((len(lengths), h_q, d)).astype(np.float32)
        self.keys, self.values, self.q = (mx.array(a).astype(dtype) for a in (keys, values, q))
        self.dtype = dtype
        self.scale = 1.0 / math.sqrt(d)

    def run(self, impl, fast: bool, scale=None) -> mx.array:
        table = mx.array(self.padded, dtype=mx.int32)
        lengths = mx.array(self.lengths, dtype=mx.int32)
        out = impl.paged_decode_attention(
            self.q, self.keys, self.values, table, lengths, scale or self.scale, fast
        )
        return out.astype(mx.float32)

    def gathered(self, b: int, n: int | None = None, pages=None):
        """Row b's keys and values [H_kv, n, D] in float32, its pages in table order."""
        n = self.lengths[b] if n is None else n
        pages = mx.array(self.tables[b] if pages is None else pages)
        k = self.keys[pages].astype(mx.float32).swapaxes(0, 1).reshape(self.h_kv, -1, self.d)
        v = self.values[pages].astype(mx.float32).swapaxes(0, 1).reshape(self.h_kv, -1, self.d)
        return k[:, :n], v[:, :n]

    def mlx_oracle(self) -> mx.array:
        """MLX's own attention, row by row, over the gathered pages."""
        rows = []
        for b in range(len(self.lengths)):
            k, v = self.gathered(b)
            q = self.q[b].astype(mx.float32)[None, :, None, :]  # [1, H_q, 1, D]
            out = mx.fast.scaled_dot_product_attention(q, k[None], v[None], scale=self.scale)
            rows.append(out[0, :, 0, :])
        return mx.stack(rows)

    def numpy_attention(self, kv_of=None, length_of=None, scale=None, pages_of=None, rescale=True):
        """Attention in float64, with one slip or another (the likely bugs)."""
        group = self.h_q // self.h_kv
        kv_of = kv_of or (lambda h: h // group)
        scale = self.scale if scale is None else scale
        out = np.zeros((len(self.lengths), self.h_q, self.d))
        for b, n in enumerate(self.lengths):
            n = length_of(n) if length_of else n
            pages = pages_of(b) if pages_of else None
            if n == 0:  # nothing walked: 0 / 0
                out[b] = np.nan
                continue
            k, v = self.gathered(b, n, pages)
            k, v = np.array(k, np.float64), np.array(v, np.float64)
            for h in range(self.h_q):
                s = k[kv_of(h)] @ np.array(self.q[b, h].astype(mx.float32), np.float64) * scale
                if rescale is True:
                    running = np.full_like(s, s.max())
                elif rescale == "position":  # the max moves, the sums so far stay where they were
                    running = np.maximum.accumulate(s)
                else:  # the same, a page at a time
                    tops = [s[i : i + self.page].max() for i in range(0, len(s), self.page)]
                    running = np.repeat(np.maximum.accumulate(tops), self.page)[: len(s)]
                w = np.exp(s - running)
                out[b, h] = w @ v[kv_of(h)] / w.sum()
        return out

    def likely_bug(self, got: np.ndarray, tol: float) -> str:
        p = self.page
        rescale = (
            "the softmax not rescaled when the max changes: multiply the sum and the "
            "accumulator by exp(m_old - m_new) before adding the new terms"
        )
        slips = {
            rescale: dict(rescale="position"),
            rescale + " (a page at a time)": dict(rescale="page"),
            "the last page read past the row's length: a row sees its first lengths[b] "
            "positions, the last page may be partly filled": dict(
                length_of=lambda n: -(-n // p) * p
            ),
            "the partly filled last page left out": dict(length_of=lambda n: n // p * p),
            "the wrong KV head for a query head: query head h reads KV head h // (H_q / H_kv)": (
                dict(kv_of=lambda h: h % self.h_kv)
            ),
            "the scale left out: scores are scale * q . k": dict(scale=1.0),
            "the page table not used: position s lives in page page_table[b, s / P], "
            "not in page s / P": dict(pages_of=lambda b: list(range(len(self.tables[b])))),
        }
        for slip, kwargs in slips.items():
            try:
                wrong = self.numpy_attention(**kwargs)
            except (IndexError, ValueError):
                continue
            near = np.allclose(got, wrong, rtol=0, atol=tol, equal_nan=True)
            if near and not np.allclose(wrong, self.numpy_attention(), rtol=0, atol=tol):
                return slip
        if np.isnan(got).any():
            rows = sorted({int(b) for b in np.argwhere(np.isnan(got))[:, 0]})
            return f"rows {rows} are nan: l stayed 0, so some positions were never walked"
        if np.abs(got).max() > JUNK / 4:
            return "values of slots no row owns were read (padding, past a length, other pages)"
        bad = np.argwhere(np.abs(got - self.numpy_attention()).max(axis=-1) > tol)
        return f"(row, query head) pairs {bad[:6].tolist()} differ"


def check(impl, case: Case, fast: bool, what: str):
    got = np.array(case.run(impl, fast))
    want = np.array(case.mlx_oracle())
    tol = kernel_tolerance(case.dtype, want)
    err = np.abs(got - want).max()
    assert err <= tol, (
        f"{what}: off by {err:.3g} (tolerance {tol:.3g}) from MLX's attention over the gathered "
        f"pages; likely: {case.likely_bug(got, tol)}"
    )


# lengths of one batch: a single position, exact page multiples, partly filled last pages
RAGGED = [1, 16, 37, 48, 5]
GROUPS = [(4, 4), (4, 2), (8, 2)]  # (H_q, H_kv): groups of 1, 2, 4


# --- Task 1: the plain walk -----------------------------------------------------------------------


@pytest.mark.parametrize("h_q, h_kv", GROUPS)
@pytest.mark.parametrize("d", [64, 128])
def test_plain_walk_matches_mlx(impl, h_q, h_kv, d):
    case = Case(RAGGED, h_q, h_kv, d, page=16, seed=d + h_q)
    check(impl, case, False, f"plain walk, H_q={h_q}, H_kv={h_kv}, D={d}")


@pytest.mark.parametrize("page", [1, 5])
def test_plain_walk_on_small_pages(impl, page):
    case = Case([1, page, 3 * page, 2 * page + 1], 8, 2, 64, page=page, seed=page)
    check(impl, case, False, f"plain walk, pages of {page}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_plain_walk_in_half_types(impl, dtype):
    case = Case(RAGGED, 8, 2, 64, page=16, dtype=DTYPES[dtype], seed=3)
    check(impl, case, False, f"plain walk in {dtype} (float32 sums)")


def test_plain_walk_equals_week3_paged_attention(impl):
    """The Week 3 Day 5 op over the same pool, tables and lengths."""
    case = Case(RAGGED, 8, 2, 64, page=16, seed=4)
    pool = impl.TinyKvPagedPool(2, 64, page_size=16, read_in_place=True)
    pool.key_pages, pool.value_pages = case.keys, case.values
    want = impl.paged_attention(case.q[:, :, None], pool, case.tables, case.lengths)[:, :, 0]
    got = case.run(impl, False)
    tol = kernel_tolerance(mx.float32, np.array(want))
    assert np.abs(np.array(got) - np.array(want)).max() <= tol, (
        f"the plain walk differs from paged_attention; likely: {case.likely_bug(np.array(got), tol)}"
    )


# --- Tasks 2 and 3: the fast walk -----------------------------------------------------------------


@pytest.mark.parametrize("h_q, h_kv", GROUPS)
@pytest.mark.parametrize("d", [64, 128])
def test_fast_walk_matches_mlx(impl, h_q, h_kv, d):
    case = Case(RAGGED, h_q, h_kv, d, page=16, seed=d + h_q)
    check(impl, case, True, f"fast walk, H_q={h_q}, H_kv={h_kv}, D={d}")


@pytest.mark.parametrize("page", [1, 5, 64])
def test_fast_walk_on_other_page_sizes(impl, page):
    case = Case([1, page, 3 * page, 2 * page + 1], 8, 2, 64, page=page, seed=page)
    check(impl, case, True, f"fast walk, pages of {page}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fast_walk_in_half_types(impl, dtype):
    case = Case(RAGGED, 8, 2, 64, page=16, dtype=DTYPES[dtype], seed=3)
    check(impl, case, True, f"fast walk in {dtype} (float32 sums)")


def test_fast_walk_large_enough_for_threads(impl):
    """Long rows of different lengths: enough work that the pairs are shared among threads."""
    case = Case([2000, 1500, 1777, 16, 1, 900], 8, 2, 128, page=16, seed=7)
    check(impl, case, True, "fast walk over long rows (threaded): every pair must be computed once")


def test_fast_equals_plain(impl):
    case = Case(RAGGED, 8, 2, 128, page=16, seed=9)
    fast, plain = np.array(case.run(impl, True)), np.array(case.run(impl, False))
    assert np.abs(fast - plain).max() < 1e-5, "the fast and the plain walk give other answers"


# --- Task 4: decode rows of the model through the kernel ------------------------------------------


def kernel_calls(impl, monkeypatch) -> list:
    """Counts the calls of the kernel made by own_decode_attention."""
    module = importlib.import_module(f"{impl.__name__}.paged_decode")
    calls, real = [], module.paged_decode_attention
    monkeypatch.setattr(
        module, "paged_decode_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    )
    return calls


PROMPT_TOKENS = 29
DECODE_STEPS = 5


@pytest.mark.parametrize("page_size", [4, 16])
def test_model_with_kernel_equals_dense_model(impl, model, tokenizer, monkeypatch, page_size):
    """Prefill over pages in place, then decode steps through the kernel: the logits of a dense
    cache (1e-4), the greedy tokens the same; prefill never goes through the kernel."""
    calls = kernel_calls(impl, monkeypatch)
    ids = tokenizer.encode(prompt_with_tokens(tokenizer, PROMPT_TOKENS))
    dense = model.create_kv_cache()
    pools = impl.use_own_decode_kernel(model.create_kv_pools(page_size, read_in_place=True))
    paged = model.create_paged_kv_cache(pools)
    want = model(mx.array([ids]), 0, dense)
    assert_close(model(mx.array([ids]), 0, paged), want, "prefill over pages in place")
    assert not calls, "prefill (many queries per row) must keep paged_attention's walk"
    token, offset = mx.argmax(want[0, -1]).item(), len(ids)
    for step in range(DECODE_STEPS):
        want = model(mx.array([[token]]), offset, dense)
        got = model(mx.array([[token]]), offset, paged)
        assert_close(
            got,
            want,
            f"decode step {step} through the kernel (pages of {page_size}): own_decode_attention "
            "pads every table to the longest, passes query[:, :, 0] and int32 lengths, and gives "
            "back [B, H_q, 1, D]",
        )
        assert mx.argmax(got[0, -1]).item() == mx.argmax(want[0, -1]).item()
        token, offset = mx.argmax(want[0, -1]).item(), offset + 1
    assert len(calls) == DECODE_STEPS * model.num_hidden_layers, (
        f"{len(calls)} kernel calls for {DECODE_STEPS} decode steps of "
        f"{model.num_hidden_layers} layers: every decode row goes through the kernel"
    )


LENGTHS = (10, 12, 9, 14, 11, 8)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("policy", ["alternate", "hybrid"])
def test_engine_with_kernel_generates_the_tokens_without(
    impl, tiny_gqa_ckpt, tokenizer, policy, compiled, monkeypatch
):
    """Batched decode (alternate) and ragged passes (hybrid) with the kernel on, blocks eager or
    compiled (3.3): the greedy tokens of the engine over dense caches and over pages read in
    place without the kernel."""
    model = impl.Qwen3Model(tiny_gqa_ckpt, compiled=compiled)
    calls = kernel_calls(impl, monkeypatch)
    prompts = [tokenizer.encode(prompt_with_tokens(tokenizer, n)) for n in LENGTHS]
    settings = dict(max_seq_len=64, batch_size=4, prefill_step=8, policy=policy)
    runs = {}
    for name in ("dense", "paged", "kernel"):
        pools = None
        if name != "dense":
            pools = model.create_kv_pools(page_size=4, read_in_place=True)
        if name == "kernel":
            impl.use_own_decode_kernel(pools)
        engine = impl.Engine(model, tokenizer, pools=pools, **settings)
        runs[name] = serve_greedy(engine, prompts, 12)
    assert calls, f"{policy}: no decode row went through the kernel"
    for other in ("dense", "paged"):
        assert runs["kernel"] == runs[other], (
            f"{policy}, compiled={compiled}: with the kernel the engine generated other tokens "
            f"than over {other} caches; decode rows of a batch have different lengths: one "
            "table row and one length per request, in the batch's order"
        )


def test_speculation_with_kernel_generates_the_plain_tokens(impl, model, tokenizer, monkeypatch):
    """Speculative decoding (prompt lookup, hybrid passes): verify passes keep paged_attention,
    plain decode rows go through the kernel; the greedy tokens are the plain engine's."""
    calls = kernel_calls(impl, monkeypatch)
    base = tokenizer.encode(prompt_with_tokens(tokenizer, 9))
    prompts = [base * 3, base + base[:4], tokenizer.encode(prompt_with_tokens(tokenizer, 14))]
    settings = dict(max_seq_len=96, batch_size=3, prefill_step=16, policy="hybrid")
    plain = serve_greedy(impl.Engine(model, tokenizer, **settings), prompts, 14)
    pools = impl.use_own_decode_kernel(model.create_kv_pools(page_size=4, read_in_place=True))
    engine = impl.Engine(
        model, tokenizer, pools=pools, speculative=impl.PromptLookup(2), **settings
    )
    got = serve_greedy(engine, prompts, 14)
    assert calls, "no decode row went through the kernel"
    assert got == plain, "speculation with the kernel generated other tokens than plain decoding"

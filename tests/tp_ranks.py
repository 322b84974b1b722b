"""The two-rank half of the Week 4 Day 2 tests (and of Week 4 Day 6's expert parallelism):
run by every rank under mlx.launch.

    mlx.launch -n 2 --backend ring --python PYTHON tests/tp_ranks.py
        --impl tiny_llm_ref --out DIR --ckpt DIR --ckpt-kv1 DIR --ckpt-odd-mlp DIR
    mlx.launch ... tests/tp_ranks.py --impl tiny_llm_ref --out DIR --ckpt MOE_DIR
        --ckpt-odd-experts DIR --checks moe
    mlx.launch ... tests/tp_ranks.py --impl tiny_llm_ref --out DIR --ckpt DIR --checks ring
    mlx.launch -n 3 ... tests/tp_ranks.py ... --checks ring3   (the ring on three ranks)

Each rank runs every check in CHECKS, in the same order, and after each one writes what it
found to DIR/rank<r>.json: {check: null when it passed, else the error text}. A check first
computes everything it needs (every rank must run the same collective operations, in the
same order) and only then compares, so a failed comparison on one rank cannot leave the other
waiting in an all_sum. The oracle everywhere is the same package's unsharded model on the
same weights, and in check_mlx_lm mlx-lm's own shard().

A rank that dies (an exception outside a check) writes why into its JSON and exits non-zero,
and mlx.launch then stops the other ranks instead of leaving them in an all_sum that would
never return. `--die-on-rank R` makes rank R die on purpose, for the test of exactly that.
"""

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np
from helpers import prompt_with_tokens

from tiny_llm_support import load_checkpoint, mlx_lm_qwen3

ATOL = RTOL = 1e-4
PROMPT_LENGTHS = (3, 9, 14, 22, 1)  # token counts of the batch_generate prompts
MAX_SEQ_LEN = 32
MAX_NEW_TOKENS = 6
DIE_AFTER_S = 1.0  # --die-on-rank: how long the rank waits before it raises


def close(actual, expected, what: str) -> None:
    actual, expected = np.array(actual), np.array(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=RTOL, err_msg=what)


class Ranks:
    """What every check gets: the package, the group, the checkpoints, a sharded model, and
    the unsharded model with the results it gives (computed once, kept for every check)."""

    def __init__(self, args: argparse.Namespace, group):
        self.impl = importlib.import_module(args.impl)
        self.group = group
        self.n, self.rank = group.size(), group.rank()
        self.ckpt = load_checkpoint(args.ckpt)
        self.ckpt_kv1, self.ckpt_odd_mlp, self.ckpt_odd_experts = (
            load_checkpoint(path) if path else None
            for path in (args.ckpt_kv1, args.ckpt_odd_mlp, args.ckpt_odd_experts)
        )
        self.tokenizer = self.ckpt.tokenizer
        self.ids = self.tokenizer.encode(prompt_with_tokens(self.tokenizer, 11))
        self.prompts = [prompt_with_tokens(self.tokenizer, n) for n in PROMPT_LENGTHS]
        self.full = self.impl.Qwen3Model(self.ckpt)
        self._sharded = None
        self._texts = {}

    @property
    def sharded(self):
        """One sharded model for the checks that only need fresh caches (built on first use:
        Task 4 may not be written yet)."""
        if self._sharded is None:
            self._sharded = self.model(True)
        return self._sharded

    def model(self, sharded: bool, **kwargs):
        model = self.impl.Qwen3Model(self.ckpt, **kwargs)
        if sharded:
            model.shard(self.group)
        return model

    def generate(self, model, policy: str = "alternate", pools=None) -> list:
        return self.impl.batch_generate(
            model, self.tokenizer, self.prompts, MAX_SEQ_LEN, batch_size=3, prefill_step=8,
            pools=pools, max_new_tokens=MAX_NEW_TOKENS, policy=policy,
        )  # fmt: skip

    def full_text(self, policy: str = "alternate") -> list:
        """What the unsharded model generates for the prompts (computed once per policy)."""
        if policy not in self._texts:
            self._texts[policy] = self.generate(self.full, policy)
        return self._texts[policy]

    def full_logits(self) -> mx.array:
        """The unsharded model's logits [1, 11, V] for the prompt ids, in one pass."""
        return self.full(mx.array([self.ids]), 0, self.full.create_kv_cache())


# --- Task 1: the sharded linears -----------------------------------------------------------


def check_linears(r: Ranks) -> None:
    """Column-parallel: each rank's output is its own slice of the full output, in rank order.
    Row-parallel: each rank, given its slice of the input, gets the whole output."""
    w = mx.random.normal((12, 8), key=mx.random.key(1))  # [O, I], the same on every rank
    x = mx.random.normal((3, 8), key=mx.random.key(2))
    full = np.array(x) @ np.array(w).T  # [3, 12]
    column = r.impl.ColumnParallelLinear(w, r.group)
    part = slice(r.rank * 8 // r.n, (r.rank + 1) * 8 // r.n)
    row = r.impl.RowParallelLinear(w, r.group)
    column_out, row_out = column(x), row(x[:, part])
    mx.eval(column_out, row_out)
    outputs = slice(r.rank * 12 // r.n, (r.rank + 1) * 12 // r.n)
    assert tuple(column.weight.shape) == (12 // r.n, 8), "column-parallel keeps [O / N, I]"
    assert tuple(row.weight.shape) == (12, 8 // r.n), "row-parallel keeps [O, I / N]"
    close(column_out, full[:, outputs], f"column-parallel output of rank {r.rank}")
    partial = x[:, part] @ row.weight.T  # this rank's product before the all_sum
    problem = reduction_bug(row_out, full, partial, r.n, "the row-parallel output")
    assert problem is None, problem


def check_linear_errors(r: Ranks) -> None:
    """A dimension that does not divide by the group size is a ValueError."""
    for make, shape in [(r.impl.ColumnParallelLinear, (5, 8)), (r.impl.RowParallelLinear, (8, 5))]:
        try:
            make(mx.zeros(shape), r.group)
        except ValueError:
            continue
        raise AssertionError(f"{make.__name__} of a {shape} weight over {r.n} ranks must raise")


# --- Tasks 2-4: the sharded model ----------------------------------------------------------


def check_one_shot_logits(r: Ranks) -> None:
    """A batch of two prompts in one pass, sharded against unsharded."""
    tokens = mx.array([r.ids, r.ids[::-1]])  # [2, 11]
    got = r.sharded(tokens, 0, r.sharded.create_kv_cache())
    want = r.full(tokens, 0, r.full.create_kv_cache())
    close(got, want, "one-shot logits, sharded vs one process")


def check_weights_are_split(r: Ranks) -> None:
    """Each rank holds H / N query heads, H_kv / N KV heads and I / N MLP features."""
    c, model = r.ckpt.config, r.sharded
    d = c.head_dim
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        assert (a.num_heads, a.num_kv_heads) == (
            c.num_attention_heads // r.n,
            c.num_key_value_heads // r.n,
        ), f"layer {i}: heads per rank"
        shapes = [tuple(w.shape) for w in (a.wq, a.wk, a.wv, a.o_proj.weight)]
        want = [
            (c.num_attention_heads // r.n * d, c.hidden_size),
            (c.num_key_value_heads // r.n * d, c.hidden_size),
            (c.num_key_value_heads // r.n * d, c.hidden_size),
            (c.hidden_size, c.num_attention_heads // r.n * d),
        ]
        assert shapes == want, (
            f"layer {i}: wq, wk, wv, o_proj.weight shapes {shapes}, expected {want}"
        )
        m = layer.mlp
        shapes = [tuple(p.weight.shape) for p in (m.gate_proj, m.up_proj, m.down_proj)]
        part = c.intermediate_size // r.n
        want = [(part, c.hidden_size), (part, c.hidden_size), (c.hidden_size, part)]
        assert shapes == want, f"layer {i}: gate/up/down_proj shapes {shapes}, expected {want}"


def reduction_bug(got, want, partial, n: int, where: str) -> str | None:
    """Which classic mistake makes a row-parallel output `got` differ from the unsharded `want`
    (`partial`: this rank's product before the all_sum), or None when it matches."""
    got, want, partial = np.array(got), np.array(want), np.array(partial)
    if np.allclose(got, want, atol=ATOL, rtol=RTOL):
        return None
    if np.allclose(got, partial, atol=ATOL, rtol=RTOL):
        return f"{where} is this rank's partial sum only: all_sum it over the group"
    if np.allclose(got, n * want, atol=ATOL, rtol=RTOL):
        return f"{where} is {n} times the unsharded output: the all_sum is done twice"
    return f"{where} differs from the unsharded output (max diff {np.abs(got - want).max():.3g})"


def check_each_reduction(r: Ranks) -> None:
    """o_proj and down_proj, each on its own: every rank gets the unsharded output, neither the
    rank's partial product (a missing all_sum) nor n times the output (one all_sum too many)."""
    full, shard = r.full.layers[0], r.sharded.layers[0]
    x = mx.random.normal((1, 5, r.ckpt.config.hidden_size), key=mx.random.key(3))
    m = shard.mlp
    partial = (
        mx.sigmoid(m.gate_proj(x)) * m.gate_proj(x) * m.up_proj(x)
    ) @ m.down_proj.weight.T  # this rank's product before any all_sum
    problems = [reduction_bug(m(x), full.mlp(x), partial, r.n, "the MLP's down_proj output")]
    heads = full.self_attn.num_heads // r.n
    out = mx.random.normal(
        (1, full.self_attn.num_heads, 5, r.ckpt.config.head_dim), key=mx.random.key(5)
    )
    mine = out[:, r.rank * heads : (r.rank + 1) * heads]  # this rank's heads' outputs
    partial = mine.swapaxes(1, 2).reshape(1, 5, -1) @ shard.self_attn.o_proj.weight.T
    got, want = shard.self_attn.project(mine), full.self_attn.project(out)
    problems.append(reduction_bug(got, want, partial, r.n, "attention's o_proj output"))
    problems = [p for p in problems if p]
    assert not problems, "; ".join(problems)


def check_heads_are_whole_and_this_ranks(r: Ranks) -> None:
    """The sharded attention's queries, keys and values are the unsharded ones' heads of this
    rank: whole heads (rows h * head_dim .. (h + 1) * head_dim of wq), in rank order."""
    full, shard = r.full.layers[0].self_attn, r.sharded.layers[0].self_attn
    x = mx.random.normal((1, 4, r.ckpt.config.hidden_size), key=mx.random.key(4))
    for name, got, want in zip("qkv", shard.qkv(x, 0), full.qkv(x, 0)):
        per_rank = want.shape[1] // r.n
        share = lambda rank, w=want, k=per_rank: np.array(w[:, rank * k : (rank + 1) * k])
        got = np.array(got)
        if got.shape == share(r.rank).shape and np.allclose(got, share(r.rank), atol=ATOL):
            continue
        others = [o for o in range(r.n) if o != r.rank]
        if any(
            got.shape == share(o).shape and np.allclose(got, share(o), atol=ATOL) for o in others
        ):
            raise AssertionError(
                f"rank {r.rank}'s {name} heads are another rank's: rank r keeps heads "
                f"r * {per_rank} .. (r + 1) * {per_rank} - 1"
            )
        raise AssertionError(
            f"rank {r.rank}'s {name} are not whole heads of the unsharded model: split the rows "
            "of each projection on head boundaries (whole blocks of head_dim rows), so that "
            "QK-norm and RoPE see whole heads"
        )


def check_chunked_prefill(r: Ranks) -> None:
    """Chunks of 5, 4 and 2 tokens on a sharded cache give the one-pass logits' rows."""
    cache, got, start = r.sharded.create_kv_cache(), [], 0
    for size in (5, 4, 2):
        got.append(r.sharded(mx.array([r.ids[start : start + size]]), start, cache))
        start += size
    close(mx.concatenate(got, axis=1), r.full_logits(), "chunked prefill, sharded vs one pass")


def check_cached_decode(r: Ranks) -> None:
    """Prefill, then six greedy decode steps: every step's logits match one process."""

    def decode(model):
        cache, logits = model.create_kv_cache(), []
        step = model(mx.array([r.ids]), 0, cache)[:, -1:, :]
        for i in range(6):
            logits.append(step)
            token = mx.argmax(step[0, -1]).item()
            step = model(mx.array([[token]]), len(r.ids) + i, cache)
        return mx.concatenate(logits, axis=1), cache

    (got, cache), (want, _) = decode(r.sharded), decode(r.full)
    close(got, want, "cached decode logits, sharded vs one process")
    heads = [layer_cache.keys.shape[1] for layer_cache in cache]
    want_heads = r.ckpt.config.num_key_value_heads // r.n
    assert heads == [want_heads] * len(cache), (
        f"each rank's dense cache must hold num_key_value_heads / world_size = {want_heads} "
        f"KV heads per layer, holds {heads}"
    )


def check_paged_kv_heads(r: Ranks) -> None:
    """The pools of a sharded model store only this rank's KV heads, and it decodes as one
    process does."""
    pools = r.sharded.create_kv_pools(page_size=4)
    got = r.generate(r.sharded, pools=pools)
    want_heads = r.ckpt.config.num_key_value_heads // r.n
    assert [p.num_kv_heads for p in pools] == [want_heads] * len(pools), (
        f"each pool must hold {want_heads} KV heads (num_key_value_heads / world_size)"
    )
    pages = {tuple(page.shape) for p in pools for page in p.key_pages}
    assert pages == {(want_heads, 4, r.ckpt.config.head_dim)}, f"page shapes {pages}"
    assert got == r.full_text(), "batch_generate with paged caches: sharded text differs"


def check_greedy_text(r: Ranks) -> None:
    """simple_generate_with_kv_cache writes the same tokens sharded and unsharded."""
    got = list(r.impl.simple_generate_with_kv_cache(r.sharded, r.ids, 8))
    want = list(r.impl.simple_generate_with_kv_cache(r.full, r.ids, 8))
    assert got == want, f"greedy tokens: sharded {got}, one process {want}"


def check_batch_generate(r: Ranks) -> None:
    """Continuous batching with chunked prefill (dense caches), both policies."""
    for policy in ("alternate", "hybrid"):
        got = r.generate(r.sharded, policy)
        assert got == r.full_text(policy), f"batch_generate ({policy}): sharded text differs"


def check_compiled(r: Ranks) -> None:
    """A compiled model (Week 3 Day 3) sharded after it was built: chunked logits and
    batch_generate (padded chunks, hybrid policy) as one process gives them."""
    sharded = r.model(True, compiled=True)
    cache = sharded.create_kv_cache()
    got = [sharded(mx.array([r.ids[:7]]), 0, cache), sharded(mx.array([r.ids[7:]]), 7, cache)]
    text = r.generate(sharded, "hybrid")
    close(mx.concatenate(got, axis=1), r.full_logits(), "compiled sharded model, chunked logits")
    assert text == r.full_text("hybrid"), "compiled sharded batch_generate differs"


def check_ragged(r: Ranks) -> None:
    """forward_ragged (Week 3 Day 4): a decode row and a prompt chunk in one sharded pass."""

    def ragged(model):
        old, new = model.create_kv_cache(), model.create_kv_cache()
        model(mx.array([r.ids[:6]]), 0, old)
        segments = [r.impl.Segment(old, 0, 1), r.impl.Segment(new, 1, 4)]
        tokens = mx.array([[r.ids[6], *r.ids[:4]]])  # [1, 5]
        return r.impl.forward_ragged(model, tokens, segments)

    got, want = ragged(r.sharded), ragged(r.full)
    close(got, want, "forward_ragged logits, sharded vs one process")


def check_mlx_lm(r: Ranks) -> None:
    """Ours against mlx-lm's Model.shard() over the same group, on the same weights."""
    tokens = mx.array([r.ids])
    theirs = mlx_lm_qwen3(r.ckpt)
    theirs.shard(r.group)
    ours = r.sharded(tokens, 0, r.sharded.create_kv_cache())
    close(ours, theirs(tokens), "ours vs mlx-lm's shard()")


def check_errors(r: Ranks) -> None:
    """Heads or MLP features that do not divide by the world size: a ValueError naming them,
    and the model is unchanged; sharding twice is an error too."""
    for ckpt, name in [(r.ckpt_kv1, "num_key_value_heads"), (r.ckpt_odd_mlp, "intermediate_size")]:
        model = r.impl.Qwen3Model(ckpt)
        layers = list(model.layers)
        try:
            model.shard(r.group)
        except ValueError as e:
            assert name in str(e), f"the error must name {name}: {e}"
        else:
            raise AssertionError(f"{name} of {ckpt.config} over {r.n} ranks must raise")
        assert all(a is b for a, b in zip(model.layers, layers)), "a failed shard() changed layers"
    attn = r.impl.Qwen3Model(r.ckpt_kv1).layers[0].self_attn  # 1 KV head, 1 * D rows of wk
    try:
        r.impl.TensorParallelAttention(attn, r.group)
    except ValueError:
        pass
    else:
        raise AssertionError(
            f"TensorParallelAttention of 1 KV head over {r.n} ranks must raise ValueError (Task "
            "2: rank_slice of both head counts); wk's H_kv * D rows divide, so without that check "
            "each rank would keep half of a KV head's features"
        )
    try:
        r.sharded.shard(r.group)
    except ValueError:
        return
    raise AssertionError("sharding a sharded model again must raise ValueError")


# --- Week 4 Day 6: expert parallelism on a mixture of experts ------------------------------


def check_experts_split(r: Ranks) -> None:
    """Each rank keeps E / N whole experts of every sparse layer, its own contiguous share,
    and the whole router."""
    n_experts, per_rank = r.ckpt.config.num_experts, r.ckpt.config.num_experts // r.n
    mine = slice(r.rank * per_rank, (r.rank + 1) * per_rank)
    for i, (layer, full) in enumerate(zip(r.sharded.layers, r.full.layers)):
        for name in ("w_gate", "w_up", "w_down"):
            got, whole = getattr(layer.mlp, name), getattr(full.mlp, name)
            assert got.shape[0] == per_rank, (
                f"layer {i}: {name} holds {got.shape[0]} experts on rank {r.rank}, expected "
                f"num_experts / world_size = {n_experts} / {r.n}"
            )
            assert mx.array_equal(got, whole[mine]).item(), (
                f"layer {i}: rank {r.rank} must keep experts {mine.start}..{mine.stop - 1} "
                f"(its contiguous share, in rank order) of {name}"
            )
        assert mx.array_equal(layer.mlp.w_router, full.mlp.w_router).item(), (
            f"layer {i}: the router stays whole on every rank (every token is routed over all "
            "experts)"
        )


def check_expert_errors(r: Ranks) -> None:
    """Experts that do not divide by the world size: a ValueError naming num_experts, and the
    model is unchanged."""
    model = r.impl.Qwen3Model(r.ckpt_odd_experts)
    layers = list(model.layers)
    try:
        model.shard(r.group)
    except ValueError as e:
        assert "num_experts" in str(e), f"the error must name num_experts: {e}"
    else:
        raise AssertionError(
            f"{r.ckpt_odd_experts.config.num_experts} experts over {r.n} ranks must raise"
        )
    assert model.layers == layers, "a failed shard() must leave the model as it was"


# --- Week 4 Day 7: ring attention, the prompt split over the ranks ----------------------------


def check_ring_prefill(r: Ranks) -> None:
    """The 11-token prompt split 6 / 5: the last token's logits equal one process's, on every
    rank."""
    _, logits = r.impl.ring_prefill(r.full, r.ids, r.group)
    close(
        logits, r.full_logits()[:, -1, :],
        "ring prefill, last token's logits vs one process (is each block that arrives merged "
        "only when it comes from an earlier part, and the own part attended causally?)",
    )  # fmt: skip


def check_ring_holds_its_part(r: Ranks) -> None:
    """Each rank keeps the keys/values of its own part only, the ones one process computes
    for those positions."""
    caches, _ = r.impl.ring_prefill(r.full, r.ids, r.group)
    start, stop = r.impl.split_sequence(len(r.ids), r.n)[r.rank]
    whole = r.full.create_kv_cache()
    r.full(mx.array([r.ids]), 0, whole)
    for i, (cache, full) in enumerate(zip(caches, whole)):
        assert cache.holds == stop - start, (
            f"layer {i}: rank {r.rank} holds {cache.holds} tokens, its part is {start}..{stop - 1}"
        )
        close(cache.local.keys[:, :, : cache.holds], full.keys[:, :, start:stop], f"layer {i} keys")


def check_ring_decode(r: Ranks) -> None:
    """Eight greedy tokens after the ring prefill: the one-process tokens, every rank the same;
    the new tokens' keys/values go to the last rank."""
    got = r.impl.ring_generate(r.full, r.ids, r.group, 8)
    want = list(r.impl.simple_generate_with_kv_cache(r.full, r.ids, 8))
    assert got == want, (
        f"tokens after the ring prefill {got} != one process {want} (a decode step merges "
        "every rank's partial result: max, sum and output)"
    )


def check_ring_decode_logits(r: Ranks) -> None:
    """Four decode steps after the ring prefill: each step's logits equal one process's, not
    only its greedy token (a merge that adds the ranks' sums without rescaling them to a common
    maximum can keep the argmax of a tiny model and still be wrong)."""
    caches, _ = r.impl.ring_prefill(r.full, r.ids, r.group)
    whole = r.full.create_kv_cache()
    want = [r.full(mx.array([r.ids]), 0, whole)[:, -1, :]]
    got = []
    for i in range(4):  # every rank runs every step before any comparison
        token, position = mx.argmax(want[-1][0]).item(), len(r.ids) + i
        got.append(r.full(mx.array([[token]]), position, caches)[:, -1, :])
        want.append(r.full(mx.array([[token]]), position, whole)[:, -1, :])
        mx.eval(got[-1], want[-1])
    for i, (g, w) in enumerate(zip(got, want[1:])):
        close(
            g,
            w,
            f"decode step {i + 1} after the ring prefill, logits vs one process ({MERGE_HINT})",
        )


# --- the ring's two tasks alone, batch 2, on random inputs (2 and 3 ranks) ------------------------

RING_SHAPE = (2, 4, 2, 10, 8)  # batch, query heads, KV heads, tokens, head dim (4/3/3 on 3)
MERGE_HINT = (
    "merge_ranks: all_gather each of max, sum and output with a new leading axis (x[None]) so "
    "that gathered[r] is rank r's whole partial, then merge them with merge_partials, which "
    "rescales every sum and output to the common maximum before adding"
)


def ring_inputs() -> tuple[mx.array, mx.array, mx.array]:
    """Queries, keys and values [B, H, T, D] of a whole sequence, the same on every rank (one
    seed). Keys grow along the sequence, so that each part's scores have a different maximum."""
    b, h_q, h_kv, t, d = RING_SHAPE
    mx.random.seed(7)
    q = mx.random.normal((b, h_q, t, d))
    k = mx.random.normal((b, h_kv, t, d)) * mx.linspace(0.5, 4.0, t)[:, None]
    return q, k, mx.random.normal((b, h_kv, t, d))


def check_ring_attention_batch2(r: Ranks) -> None:
    """ring_prefill_attention on this rank's part of a random batch of two equals the rows of
    MLX's fused causal attention over the whole sequence (on 3 ranks every block travels two
    steps, and the parts differ in length)."""
    q, k, v = ring_inputs()
    parts = r.impl.split_sequence(q.shape[2], r.n)
    start, stop = parts[r.rank]
    got = r.impl.ring_prefill_attention(
        q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], r.group, parts
    )
    mx.eval(got)
    scale = q.shape[-1] ** -0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    close(
        got, want[:, :, start:stop],
        f"ring_prefill_attention on {r.n} ranks, rank {r.rank}'s part {start}..{stop - 1}, batch "
        "2, vs fused causal attention (pass on the block you received in the last step, not your "
        "own; the block of step s comes from rank (r - s) % n, so recv its part's shape; merge it "
        "only when that part comes before yours)",
    )  # fmt: skip


def check_merge_ranks_batch2(r: Ranks) -> None:
    """The last query of a random batch of two, each rank's partial over its own part of the
    keys, merged by merge_ranks: the fused attention over every key. A merge that adds the
    ranks' sums without rescaling is named as such."""
    q, k, v = ring_inputs()
    b, h_q, h_kv, t, d = RING_SHAPE
    ring = importlib.import_module(f"{r.impl.__name__}.ring_attention")  # its given helpers
    g = ring.grouped_queries(q[:, :, -1:], h_kv)  # [B, H_kv, n_rep, 1, D]
    parts = ring.split_sequence(t, r.n)
    partials = [ring.blocked_partial(g, k[:, :, a:z], v[:, :, a:z], t - 1, a) for a, z in parts]
    merged = ring.merge_ranks(partials[r.rank], r.group)
    mx.eval(merged)
    shapes, want_shapes = [x.shape for x in merged], [x.shape for x in partials[r.rank]]
    assert shapes == want_shapes, (
        f"merge_ranks returned shapes {shapes}, a rank's partial has {want_shapes}: all_gather "
        "concatenates along the first axis, so gather x[None] (a new leading axis) and take "
        "gathered[r]; without it a batch of two mixes ranks and rows"
    )
    got = ring.finish(merged).reshape(b, h_q, 1, d)
    want = mx.fast.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=d**-0.5)
    unscaled = sum(p[2] for p in partials) / sum(p[1] for p in partials)  # the slip
    if np.allclose(np.array(got), np.array(unscaled.reshape(b, h_q, 1, d)), atol=ATOL):
        raise AssertionError(
            "merge_ranks added the ranks' sums and outputs as they are: each rank's sum and "
            "output is relative to its own maximum, so rescale them to the common maximum "
            "first (merge_partials does)"
        )
    close(got, want, f"merge_ranks on {r.n} ranks, batch 2, vs fused attention ({MERGE_HINT})")


RING_CHECKS = [
    check_ring_attention_batch2,
    check_merge_ranks_batch2,
    check_ring_prefill,
    check_ring_holds_its_part,
    check_ring_decode,
    check_ring_decode_logits,
]
RING_CHECKS_3 = [check_ring_attention_batch2, check_merge_ranks_batch2, check_ring_prefill]

MOE_CHECKS = [
    check_experts_split,
    check_one_shot_logits,
    check_chunked_prefill,
    check_cached_decode,
    check_greedy_text,
    check_batch_generate,
    check_ragged,
    check_expert_errors,
]

CHECKS = [
    check_linears,
    check_linear_errors,
    check_heads_are_whole_and_this_ranks,
    check_each_reduction,
    check_one_shot_logits,
    check_weights_are_split,
    check_chunked_prefill,
    check_cached_decode,
    check_paged_kv_heads,
    check_greedy_text,
    check_batch_generate,
    check_compiled,
    check_ragged,
    check_mlx_lm,
    check_errors,
]


def error_text(e: Exception) -> str:
    """The exception's own line first (it names the task of a stub), then where it came from."""
    last = "".join(traceback.format_exception_only(type(e), e)).strip()
    return f"{last}\n{traceback.format_exc(limit=-4)}"


class Report:
    """This rank's JSON file, rewritten after every step: the group size, each check's result
    (null when it passed, else the error text), the check running now, and why the rank died
    if it did (so that the test names the rank that stopped the run)."""

    def __init__(self, path: Path):
        self.path = path
        self.fields: dict = {}

    def write(self, **fields) -> None:
        self.fields.update(fields)
        self.path.write_text(json.dumps(self.fields))


def run_checks(args: argparse.Namespace, group, report: Report) -> None:
    """Every check in order, each one's result in the report. A check that fails records its
    error and the next one runs (a failure to compare comes after every collective)."""
    try:
        ranks, setup_error = Ranks(args, group), None
    except Exception as e:  # no model can be built yet (an earlier stub): every check fails
        ranks, setup_error = None, error_text(e)
    found: dict[str, str | None] = {}
    checks = {"tp": CHECKS, "moe": MOE_CHECKS, "ring": RING_CHECKS, "ring3": RING_CHECKS_3}
    checks = checks[args.checks]
    for check in checks:
        report.write(running=check.__name__)
        if args.die_on_rank == group.rank():
            time.sleep(DIE_AFTER_S)  # the other ranks are waiting in the check's first all_sum
            raise RuntimeError(f"told to die before {check.__name__} (--die-on-rank)")
        found[check.__name__] = setup_error or run_check(check, ranks)
        report.write(checks=found)
    report.write(running=None)


def run_check(check, ranks: Ranks) -> str | None:
    """None when the check passed, else its error text."""
    try:
        check(ranks)
    except Exception as e:
        return error_text(e)
    return None


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--impl", "--out", "--ckpt"):
        p.add_argument(name, required=True)
    for name in ("--ckpt-kv1", "--ckpt-odd-mlp", "--ckpt-odd-experts"):
        p.add_argument(name)
    p.add_argument("--checks", choices=("tp", "moe", "ring", "ring3"), default="tp")
    p.add_argument(
        "--die-on-rank", type=int, help="for the tests of this harness: that rank raises"
    )
    args = p.parse_args()
    report = Report(Path(args.out) / f"rank{os.environ.get('MLX_RANK', 'unknown')}.json")
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as e:  # the ring backend cannot start here
        report.write(init_error=str(e))
        return 0
    mx.set_default_device(mx.cpu)
    report.write(size=group.size(), checks={})
    try:
        run_checks(args, group, report)
    except BaseException as e:
        # This rank stops here. A non-zero exit makes mlx.launch stop the other ranks, which
        # could otherwise wait forever in a collective that this rank never joins.
        report.write(died=error_text(e))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Week 4 Day 6: mixture of experts.

Task 1  route (moe.py): softmax over the experts, the k most probable, renormalized or not.
Task 2  experts_loop: each expert on the tokens routed to it.
Task 3  run_pairs: the (token, expert) pairs sorted by expert, one gathered matmul per
        projection, the outputs put back in the pairs' order (experts_grouped uses it).
Task 4  Qwen3SparseMoE.__call__: route every token, run its experts.
Task 5  ExpertParallelMoE: each rank keeps E / N whole experts and runs the pairs routed to
        them; all_sum adds the ranks' outputs (two ranks under mlx.launch, tests/tp_ranks.py).

Oracles: NumPy for the router, a dense computation (every expert on every token, masked by the
routing) for the experts, and mlx-lm's qwen3_moe on the same synthetic checkpoints for the
model; exact equalities for chunked == one-shot, batched == alone and paged == dense.
"""

import importlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tp_ranks
from helpers import assert_close, prompt_with_tokens, rank_check_problems

from tiny_llm_support import (
    load_checkpoint,
    make_tiny_moe_checkpoint,
    mlx_lm_qwen3,
    quantize_checkpoint,
)

E, K, H, I = 8, 2, 16, 12  # experts, experts per token, hidden size, expert width


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """Every layer sparse: 2 of 8 experts per token, weights renormalized (norm_topk_prob)."""
    return load_checkpoint(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe"), seed=3))


@pytest.fixture(scope="module")
def moe_model(impl, moe_ckpt):
    return impl.Qwen3Model(moe_ckpt)


def experts_weights(seed=0, n=E):
    """Stacked experts: gate and up [n, I, H], down [n, H, I]."""
    keys = mx.random.split(mx.random.key(seed), 3)
    gate = mx.random.normal((n, I, H), key=keys[0]) / H**0.5
    up = mx.random.normal((n, I, H), key=keys[1]) / H**0.5
    down = mx.random.normal((n, H, I), key=keys[2]) / I**0.5
    return gate, up, down


def dense_oracle(x, experts, weights, gate, up, down) -> np.ndarray:
    """Every expert on every token (NumPy), summed with the routing weights, 0 where a token
    did not choose the expert."""
    x, experts, weights = np.array(x), np.array(experts), np.array(weights)
    gate, up, down = np.array(gate), np.array(up), np.array(down)
    silu = lambda z: z / (1 + np.exp(-z))
    routing = np.zeros((x.shape[0], gate.shape[0]), dtype=np.float32)  # [N, E]
    np.put_along_axis(routing, experts, weights, axis=1)
    outs = np.stack([(silu(x @ g.T) * (x @ u.T)) @ d.T for g, u, d in zip(gate, up, down)], 1)
    return (outs * routing[..., None]).sum(axis=1)  # [N, H]


def numpy_route(logits, k, norm):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, axis=-1)
    return top, (w / w.sum(-1, keepdims=True)) if norm else w


def by_expert(experts, weights) -> list[dict[int, float]]:
    """Each token's routing as {expert: weight}: the order of the k chosen does not matter."""
    return [dict(zip(map(int, e), map(float, w))) for e, w in zip(experts, weights)]


# --- Task 1: the router ----------------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False], ids=["renormalized", "softmax-weights"])
def test_route_picks_the_k_most_probable_experts(impl, norm):
    logits = mx.random.normal((20, E), key=mx.random.key(1)) * 2
    experts, weights = impl.route(logits, K, norm)
    assert experts.shape == (20, K) and weights.shape == (20, K), (
        f"route must give [N, k] experts and weights, got {experts.shape} and {weights.shape}"
    )
    want_e, want_w = numpy_route(np.array(logits), K, norm)
    got, want = by_expert(np.array(experts), np.array(weights)), by_expert(want_e, want_w)
    for t, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), (
            f"token {t}: route chose experts {sorted(g)}, the {K} most probable are {sorted(w)} "
            "(did it take the least probable, e.g. argpartition on p instead of -p?)"
        )
        np.testing.assert_allclose(
            [g[e] for e in sorted(w)], [w[e] for e in sorted(w)], rtol=1e-5, atol=1e-6,
            err_msg=f"token {t}: routing weights"
            + (" must be renormalized over the chosen k (norm_topk_prob)" if norm else
               " must be the softmax probabilities themselves (norm_topk_prob is false)"),
        )  # fmt: skip
    sums = np.array(weights).sum(-1)
    if norm:
        assert np.allclose(sums, 1, atol=1e-5), f"renormalized weights sum to {sums[:4]}, not 1"
    else:
        assert (sums < 1 - 1e-3).all(), "softmax weights of k < E experts sum to less than 1"


@pytest.mark.parametrize("norm", [True, False], ids=["renormalized", "softmax-weights"])
def test_route_takes_the_softmax_in_float32(impl, norm):
    """bfloat16 logits: the weights come back in bfloat16, equal to the float32 softmax (and
    renormalization) cast at the end. A softmax in bfloat16 rounds the probabilities first: a
    third or more of the weights then differ in their last bit; float32 noise flips almost none."""
    logits = (mx.random.normal((256, E), key=mx.random.key(2)) * 3).astype(mx.bfloat16)
    experts, weights = impl.route(logits, K, norm)
    assert weights.dtype == mx.bfloat16, (
        f"route returned {weights.dtype} weights for bfloat16 logits: cast them back to the "
        "logits' dtype at the end"
    )
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)  # [N, E]
    want = mx.take_along_axis(probs, experts.astype(mx.int32), axis=-1)  # [N, k]
    if norm:
        want = want / want.sum(axis=-1, keepdims=True)
    differ = (weights != want.astype(mx.bfloat16)).mean().item()
    assert differ <= 0.02, (
        f"{differ:.0%} of the bfloat16 weights differ from the float32 softmax"
        + (" and renormalization" if norm else "")
        + " cast to bfloat16 at the end: take the softmax in float32 (logits.astype(mx.float32))"
        " and cast the weights back only after they are picked"
        + (" and renormalized" if norm else "")
    )


def test_route_ties_change_nothing(impl):
    """Two chosen experts of equal probability: both are chosen, with equal weights."""
    logits = mx.array([[3.0, 0.0, 3.0, -1.0, 0.5, 0.2, -2.0, 1.0]])
    experts, weights = impl.route(logits, K, True)
    assert sorted(np.array(experts)[0].tolist()) == [0, 2], (
        f"experts 0 and 2 tie for the top: route chose {np.array(experts)[0].tolist()}"
    )
    np.testing.assert_allclose(np.array(weights)[0], [0.5, 0.5], rtol=1e-6)


# --- Tasks 2 and 3: the experts, two ways ----------------------------------------------------


def routing(n, seed, unused=()):
    """Random distinct experts per token (none from `unused`) and random weights."""
    rng = np.random.RandomState(seed)
    allowed = [e for e in range(E) if e not in unused]
    experts = np.stack([rng.choice(allowed, K, replace=False) for _ in range(n)])
    weights = rng.uniform(0.1, 1.0, (n, K)).astype(np.float32)
    return mx.array(experts), mx.array(weights)


@pytest.mark.parametrize("way", ["experts_loop", "experts_grouped"])
def test_experts_equal_the_dense_masked_computation(impl, way):
    """Experts 3 and 6 receive no token; every token's output is its experts' weighted sum."""
    x = mx.random.normal((11, H), key=mx.random.key(4))
    experts, weights = routing(11, seed=5, unused=(3, 6))
    gate, up, down = experts_weights()
    got = getattr(impl, way)(x, experts, weights, gate, up, down)
    want = dense_oracle(x, experts, weights, gate, up, down)
    assert_close(
        got, mx.array(want),
        f"{way} against every expert on every token masked by the routing (were the routing "
        "weights applied, and each output added to its own token?"
        + (" Was run_pairs' sort by expert undone?)" if way == "experts_grouped" else ")"),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("way", ["experts_loop", "experts_grouped"])
def test_the_order_of_a_tokens_experts_changes_nothing(impl, way):
    x = mx.random.normal((6, H), key=mx.random.key(6))
    experts, weights = routing(6, seed=7)
    gate, up, down = experts_weights(1)
    run = getattr(impl, way)
    got = run(x, experts[:, ::-1], weights[:, ::-1], gate, up, down)
    assert_close(
        got, run(x, experts, weights, gate, up, down),
        f"{way} with each token's experts listed in the other order", atol=1e-6, rtol=1e-6,
    )  # fmt: skip


def test_run_pairs_keeps_the_order_of_the_pairs(impl):
    """Pairs given in no particular order come back in that order (sorting by expert is
    internal: forgetting to undo it gives each pair another pair's output)."""
    x = mx.random.normal((5, H), key=mx.random.key(8))
    tokens = mx.array([4, 0, 3, 0, 2, 1, 4])
    experts = mx.array([7, 5, 0, 1, 5, 7, 2])
    gate, up, down = experts_weights(2)
    got = impl.run_pairs(x, tokens, experts, gate, up, down)
    ones = mx.ones((7, 1))
    for m, (t, e) in enumerate(zip(tokens.tolist(), experts.tolist())):
        want = dense_oracle(x[t : t + 1], mx.array([[e]]), ones[m : m + 1], gate, up, down)
        assert_close(
            got[m : m + 1], mx.array(want),
            f"pair {m} (token {t}, expert {e}): its output must come back at position {m}, "
            "in the pairs' order (undo the sort by expert)", atol=1e-5, rtol=1e-5,
        )  # fmt: skip


def test_grouped_experts_read_quantized_weights(impl, moe_ckpt):
    """With QuantizedWeight experts (4.1's kernel path) the grouped version equals the loop,
    which dequantizes each expert."""
    q = impl.Qwen3Model(quantize_checkpoint(moe_ckpt, bits=4), quantized_linear="kernel")
    moe = q.layers[0].mlp
    assert isinstance(moe.w_gate, impl.QuantizedWeight), "kernel path keeps QuantizedWeight"
    x = mx.random.normal((9, moe_ckpt.config.hidden_size), key=mx.random.key(9))
    experts, weights = routing(9, seed=10)
    grouped = impl.experts_grouped(x, experts, weights, moe.w_gate, moe.w_up, moe.w_down)
    loop = impl.experts_loop(x, experts, weights, moe.w_gate, moe.w_up, moe.w_down)
    assert_close(grouped, loop, "quantized experts: grouped vs loop", atol=1e-4, rtol=1e-4)


# --- Task 4: the block and the model -----------------------------------------------------------


def test_the_block_equals_mlx_lm(impl, moe_ckpt, moe_model):
    """Our sparse block against mlx-lm's Qwen3MoeSparseMoeBlock with the same weights, both
    ways of running the experts."""
    theirs = mlx_lm_qwen3(moe_ckpt).model.layers[1].mlp
    ours = moe_model.layers[1].mlp
    x = mx.random.normal((2, 7, moe_ckpt.config.hidden_size), key=mx.random.key(11))
    for grouped in (True, False):
        ours.grouped = grouped
        try:
            got = ours(x)
        finally:
            ours.grouped = None  # back to the per-call choice
        assert_close(got, theirs(x), f"sparse block (grouped={grouped}) vs mlx-lm", 1e-5, 1e-5)


@pytest.mark.parametrize(
    "grouped, tokens, want",
    [(True, 5, "experts_grouped"), (False, 1, "experts_loop"),
     (None, 1, "experts_grouped"), (None, 5, "experts_loop")],
)  # fmt: skip
def test_the_block_runs_the_path_use_grouped_picks(
    impl, moe_model, monkeypatch, grouped, tokens, want
):
    """__call__ runs experts_grouped when self.use_grouped(N * k) says so, else experts_loop.
    On the CPU, with grouped None, use_grouped is true for at most E pairs: 1 token is 2 pairs
    (grouped), 5 tokens are 10 pairs (the loop; 5 alone would say grouped)."""
    block = moe_model.layers[1].mlp
    assert (block.w_gate.shape[0], block.top_k) == (E, K), "the tiny MoE: 2 of 8 experts (setup)"
    module = importlib.import_module(type(block).__module__)
    ran = []
    for name in ("experts_loop", "experts_grouped"):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, name=name: ran.append(name) or real(*a)
        )
    monkeypatch.setattr(block, "grouped", grouped)  # undone after the test
    block(mx.random.normal((1, tokens, block.w_router.shape[1]), key=mx.random.key(12)))
    assert ran == [want], (
        f"grouped={grouped}, {tokens} tokens ({tokens * K} pairs): __call__ ran {ran or 'neither'}"
        f", not [{want!r}]: run experts_grouped when self.use_grouped(N * k) is true for the "
        "call's N * k pairs (not N), else experts_loop, once per call"
    )


def layouts(tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    yield "hf-one-tensor-per-expert", make_tiny_moe_checkpoint(base / "hf", seed=3)
    yield "stacked", make_tiny_moe_checkpoint(base / "st", seed=3, stacked_experts=True, shards=2)
    mixed = dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    yield "dense-and-sparse-layers", make_tiny_moe_checkpoint(base / "mix", seed=4, **mixed)


def test_the_model_equals_mlx_lm(impl, tmp_path_factory):
    """Logits against mlx-lm's qwen3_moe: both checkpoint layouts, and a model whose layers
    1 is sparse and 0, 2, 3 dense (decoder_sparse_step 2, layer 3 in mlp_only_layers)."""
    tokens = mx.array([[5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12]])
    for name, path in layouts(tmp_path_factory):
        ckpt = load_checkpoint(path)
        model = impl.Qwen3Model(ckpt)
        sparse = [type(layer.mlp).__name__ for layer in model.layers]
        want = ["Qwen3SparseMoE" if ckpt.config.is_sparse(i) else "Qwen3MLP" for i in range(4)]
        assert sparse == want[: len(sparse)], f"{name}: layer kinds {sparse}"
        got = model(tokens, 0, model.create_kv_cache())
        assert_close(got, mlx_lm_qwen3(ckpt)(tokens), f"{name}: logits vs mlx-lm's qwen3_moe")


@pytest.mark.parametrize("path", ["kernel", "dequantize-at-load"])
def test_a_quantized_moe_equals_mlx_lm(impl, moe_ckpt, path):
    """Every expert quantized (4 bits, groups of 64), as mlx-lm's convert writes it."""
    ckpt = quantize_checkpoint(moe_ckpt, bits=4)
    tokens = mx.array([[5, 17, 99, 3, 250, 41, 7, 8]])
    model = impl.Qwen3Model(ckpt, quantized_linear=path)
    got = model(tokens, 0, model.create_kv_cache())
    assert_close(got, mlx_lm_qwen3(ckpt)(tokens), f"4-bit MoE ({path}) vs mlx-lm", 1e-4, 1e-4)


def test_chunked_prefill_equals_one_shot(impl, moe_model, moe_ckpt):
    ids = moe_ckpt.tokenizer.encode(prompt_with_tokens(moe_ckpt.tokenizer, 13))
    whole = moe_model(mx.array([ids]), 0, moe_model.create_kv_cache())
    cache, parts, start = moe_model.create_kv_cache(), [], 0
    for size in (5, 1, 7):
        parts.append(moe_model(mx.array([ids[start : start + size]]), start, cache))
        start += size
    assert_close(mx.concatenate(parts, axis=1), whole, "MoE chunked prefill vs one shot")


def test_batched_equals_alone_paged_equals_dense(impl, moe_model, moe_ckpt):
    """batch_generate of several prompts under both policies, dense and paged caches, and
    compiled: each text equals the prompt generated alone (routing is per token, so batching
    changes none)."""
    tok = moe_ckpt.tokenizer
    prompts = [prompt_with_tokens(tok, n) for n in (3, 11, 6, 17)]
    run = lambda ps, **kw: impl.batch_generate(
        moe_model, tok, ps, 64, batch_size=3, prefill_step=5, max_new_tokens=8, **kw
    )
    alone = [run([p])[0][1] for p in prompts]
    for policy in ("alternate", "hybrid"):
        for paged in (False, True):
            pools = moe_model.create_kv_pools(page_size=4) if paged else None
            got = [text for _, text in run(prompts, policy=policy, pools=pools)]
            assert got == alone, f"{policy}, {'paged' if paged else 'dense'}: batched != alone"
    compiled = impl.Qwen3Model(moe_ckpt, compiled=True)  # Week 3 Day 3: the MoE compiles too
    got = impl.batch_generate(
        compiled, tok, prompts, 64, batch_size=3, prefill_step=5, max_new_tokens=8,
        policy="hybrid", query_padding=True,
    )  # fmt: skip
    assert [text for _, text in got] == alone, "compiled, padded hybrid passes: batched != alone"


# --- Task 5: expert parallelism, two ranks -----------------------------------------------------


def test_two_ranks_equal_one(impl, tmp_path_factory):
    """tests/tp_ranks.py --checks moe under mlx.launch: each rank keeps its E / 2 experts
    and the router; logits (one shot, chunked, cached decode), greedy tokens and
    batch_generate's texts equal one process; 7 experts over 2 ranks is a ValueError."""
    tmp = tmp_path_factory.mktemp("moe-ranks")
    args = ["--impl", impl.__name__, "--out", str(tmp), "--checks", "moe"]
    args += ["--ckpt", str(make_tiny_moe_checkpoint(tmp / "moe", seed=3))]
    odd = make_tiny_moe_checkpoint(tmp / "odd", seed=3, num_experts=7)
    args += ["--ckpt-odd-experts", str(odd)]
    names = [check.__name__ for check in tp_ranks.MOE_CHECKS]
    problems = rank_check_problems(Path(tp_ranks.__file__), args, tmp, names)
    assert not problems, "\n\n".join(problems)

"""Week 1 Day 6: the generation loop and the sampler.

Oracles: mlx-lm's Qwen3 with the same weights for greedy tokens; for sampling, the
distribution softmax(logits / T) cut to top-k / top-p, computed here with numpy.
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_bad_prompts_refused
from oracles import mlx_lm_greedy

DRAWS = 10_000  # one draw per row of a tiled [DRAWS, V] logits array
TOLERANCE = 0.025  # at least 5 standard deviations of an empirical frequency at DRAWS


def _chat_prompt(ckpt, text="Tell me a story."):
    tok = ckpt.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


# --- Task 1: the generation loop -------------------------------------------------------------


def test_greedy_generation_matches_mlx_lm(impl, tiny_ckpt):
    """32 greedy tokens, each step recomputing the whole sequence, equal mlx-lm's tokens."""
    prompt = _chat_prompt(tiny_ckpt)
    model = impl.Qwen3ModelWeek1(tiny_ckpt)
    argmax = lambda logits: mx.argmax(logits, axis=-1)  # Task 2's make_sampler() not needed yet
    tokens = list(impl.simple_generate(model, prompt, max_tokens=32, sampler=argmax))
    expected = mlx_lm_greedy(tiny_ckpt, prompt, 32)
    assert [int(t) for t in tokens] == expected, "greedy tokens must equal mlx-lm's"


def test_generation_stops_at_eos_and_at_max_tokens(impl, tiny_untied_ckpt):
    """Without a sampler the loop is greedy (make_sampler() with temperature 0)."""
    ckpt = tiny_untied_ckpt
    prompt = _chat_prompt(ckpt, "Once upon a time")
    free = mlx_lm_greedy(ckpt, prompt, 12)
    # pretend the first token that greedy produces at step >= 3 (and not before) is an eos
    k = next(i for i in range(3, len(free)) if free[i] not in free[:i])
    model = impl.Qwen3ModelWeek1(ckpt)
    stopped = list(impl.simple_generate(model, prompt, 12, eos_token_ids={free[k]}))
    assert [int(t) for t in stopped] == free[: k + 1], "yield the eos token, then stop"

    assert [int(t) for t in impl.simple_generate(model, prompt, max_tokens=5)] == free[:5]
    assert list(impl.simple_generate(model, prompt, max_tokens=0)) == []
    assert_bad_prompts_refused(impl.simple_generate, model, prompt)


def test_generation_uses_the_sampler_on_the_last_position(impl, tiny_gqa_ckpt):
    """The sampler gets logits [1, V] of the newest position and decides every token."""
    ckpt = tiny_gqa_ckpt
    model = impl.Qwen3ModelWeek1(ckpt)
    prompt = ckpt.tokenizer.encode("The cat")
    forced = [7, 300, 42, 7]
    seen = []

    def scripted(logits):
        seen.append(logits)
        return mx.array([forced[len(seen) - 1]])

    tokens = [int(t) for t in impl.simple_generate(model, prompt, 4, sampler=scripted)]
    assert tokens == forced, "every token is the sampler's choice"
    assert len(seen) == 4, "one sampler call per generated token"
    for step, logits in enumerate(seen):
        assert logits.shape == (1, ckpt.config.vocab_size), "the sampler gets [1, V]"
        sequence = mx.array([prompt + forced[:step]])
        expected = model(sequence)[:, -1, :]
        np.testing.assert_allclose(np.array(logits), np.array(expected), rtol=1e-5, atol=1e-5)


# --- Task 2: the sampler ----------------------------------------------------------------------


def _expected_probs(logits, temperature, top_k=None, top_p=None):
    """softmax(logits / T), restricted to the top-k and then the top-p set, renormalized."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    order = np.argsort(-p)
    if top_k is not None:
        keep[order[top_k:]] = False
    if top_p is not None:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        before = np.cumsum(q[order]) - q[order]  # mass of the tokens ranked above
        keep[order[before >= top_p]] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _frequencies(sampler, logits):
    """Empirical token frequencies from DRAWS independent draws (one per tiled row)."""
    tiled = mx.broadcast_to(mx.array(logits, dtype=mx.float32), (DRAWS, len(logits)))
    ids = sampler(tiled)
    assert ids.shape == (DRAWS,)
    return np.bincount(np.array(ids).astype(np.int64), minlength=len(logits)) / DRAWS


# probabilities 0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005 in a shuffled vocabulary order
PROBS = np.array([0.05, 0.25, 0.005, 0.40, 0.03, 0.10, 0.015, 0.15])
LOGITS = np.log(PROBS) + 3.0


def test_temperature_zero_is_argmax(impl):
    logits = mx.random.normal((6, 50), key=mx.random.key(1)) * 3
    for sampler in (impl.make_sampler(), impl.make_sampler(0.0, top_k=5, top_p=0.5, seed=3)):
        ids = sampler(logits)
        assert ids.shape == (6,)
        np.testing.assert_array_equal(np.array(ids), np.argmax(np.array(logits), axis=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_distribution(impl, temperature):
    freq = _frequencies(impl.make_sampler(temperature, seed=0), LOGITS)
    expected = _expected_probs(LOGITS, temperature)
    np.testing.assert_allclose(freq, expected, atol=TOLERANCE)


@pytest.mark.parametrize("top_k", [1, 3, 20])  # 20 is more than the 8 tokens: no cut
def test_top_k(impl, top_k):
    freq = _frequencies(impl.make_sampler(1.0, top_k=top_k, seed=1), LOGITS)
    expected = _expected_probs(LOGITS, 1.0, top_k=top_k)
    assert np.all(freq[expected == 0] == 0), "a token outside the top k was drawn"
    np.testing.assert_allclose(freq, expected, atol=TOLERANCE)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.3, 1), (0.75, 3), (0.85, 4), (1.0, 8)],  # smallest most-likely set with mass >= top_p
)
def test_top_p(impl, top_p, kept):
    freq = _frequencies(impl.make_sampler(1.0, top_p=top_p, seed=2), LOGITS)
    expected = _expected_probs(LOGITS, 1.0, top_p=top_p)
    assert np.count_nonzero(expected) == kept, "the test's own expectation"
    assert np.all(freq[expected == 0] == 0), "a token outside the top-p set was drawn"
    np.testing.assert_allclose(freq, expected, atol=TOLERANCE)


def test_keep_top_p_masks_exactly_outside_the_nucleus(impl):
    """keep_top_p alone, no randomness: the kept tokens are the smallest most-likely set whose
    probability reaches top_p; everything else becomes -inf, the kept logits are unchanged."""
    logits = mx.array(np.stack([LOGITS, LOGITS[::-1]]), dtype=mx.float32)  # [2, V]
    for top_p in (0.3, 0.75, 0.85, 1.0):
        kept = np.array(impl.keep_top_p(logits, top_p))
        for row in range(2):
            want = _expected_probs(np.array(logits[row]), 1.0, top_p=top_p) > 0
            got = np.isfinite(kept[row])
            np.testing.assert_array_equal(
                got, want, err_msg=f"top_p={top_p}, row {row}: the set of kept tokens"
            )
            np.testing.assert_allclose(kept[row][got], np.array(logits[row])[got], atol=1e-6)


def test_keep_top_p_stops_as_soon_as_the_mass_reaches_top_p(impl):
    """Four tokens of probability 1/4 each (exact in floating point): top_p = 0.5 keeps two,
    whose mass is exactly 0.5. A third token is kept only by a `<=` where `<` belongs: a token
    is kept when the tokens ranked above it hold less than top_p, not when they hold exactly
    top_p (the set already reached it)."""
    kept = np.array(impl.keep_top_p(mx.zeros((1, 4)), 0.5))
    assert np.isfinite(kept).sum() == 2, (
        f"kept {np.isfinite(kept).sum()} of four equally likely tokens for top_p=0.5; two reach it "
        "(keep a token while the probability ranked above it is < top_p, not <=)"
    )


def test_top_k_top_p_and_temperature_together(impl):
    """Scale by 1/T, keep the top k, then the top-p set of what is left."""
    freq = _frequencies(impl.make_sampler(2.0, top_k=5, top_p=0.6, seed=4), LOGITS)
    expected = _expected_probs(LOGITS, 2.0, top_k=5, top_p=0.6)
    assert np.all(freq[expected == 0] == 0), (
        "a token outside the set was drawn: divide by T, cut to top-k, then top-p of what is left"
    )
    np.testing.assert_allclose(freq, expected, atol=TOLERANCE)


def test_seed_makes_draws_reproducible(impl):
    logits = mx.zeros((64, 1000))  # uniform: every row is a fresh draw among 1000 tokens
    a, b = impl.make_sampler(1.0, seed=42), impl.make_sampler(1.0, seed=42)
    first, second = [np.array(a(logits)) for _ in range(3)], [np.array(b(logits)) for _ in range(3)]
    for x, y in zip(first, second):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(first[0], first[1]), "every call must draw anew, not repeat"
    other = np.array(impl.make_sampler(1.0, seed=43)(logits))
    assert not np.array_equal(first[0], other), "a different seed gave the same draws"


def test_sampler_rejects_bad_settings(impl):
    for kwargs in ({"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            impl.make_sampler(**{"temperature": 1.0, **kwargs})

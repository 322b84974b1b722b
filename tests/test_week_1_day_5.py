"""Week 1 Day 5: Qwen3 attention, the transformer block and the whole model (no cache).

Oracle: mlx-lm's Qwen3 (mlx_lm.models.qwen3) holding the same checkpoint weights.
"""

import dataclasses
import importlib
import re

import mlx.core as mx
import numpy as np
import pytest
from oracles import mlx_lm_logits, mlx_lm_model

ATOL = RTOL = 1e-4

PROMPTS = {
    "one-token": ["A"],
    "sentence": ["The cat sat in the garden and watched the birds."],
    "batch": ["How are you today?", "Once upon a time"],  # rows padded to one length
}


def _layer(impl, ckpt, i):
    """Layer i built from the package's parts by its given build_block, as the model does."""
    week1 = importlib.import_module(f"{impl.__name__}.qwen3_week1")
    c = ckpt.config
    rope = impl.RoPE(c.head_dim, c.max_position_embeddings, c.rope_theta)
    weights = week1.checked_weights(ckpt)
    block = week1.build_block(c, weights, i, impl.Qwen3MultiHeadAttention, rope)
    return block.self_attn, block


def _hidden(ckpt, batch, length, seed):
    """Random residual-stream activations [B, L, E] at about the scale a real layer sees."""
    shape = (batch, length, ckpt.config.hidden_size)
    return 2.0 * mx.random.normal(shape, key=mx.random.key(seed))


def _tokens(ckpt, texts):
    """Token rows [B, L]; shorter rows are right-padded by repeating their last token."""
    rows = [ckpt.tokenizer.encode(t) for t in texts]
    width = max(map(len, rows))
    return mx.array([r + [r[-1]] * (width - len(r)) for r in rows], dtype=mx.int32)


def _close(actual, expected, what):
    assert actual.shape == expected.shape, (
        f"{what}: shape {actual.shape}, expected {expected.shape}"
    )
    np.testing.assert_allclose(
        np.array(actual), np.array(expected), rtol=RTOL, atol=ATOL, err_msg=what
    )


# --- Task 1: attention with QK-norm, RoPE and GQA --------------------------------------------


@pytest.mark.parametrize("offset", [0, 5])
def test_qkv_matches_mlx_lm_projections(impl, tiny_ckpt, offset):
    """qkv alone: queries and keys projected, QK-normed and rotated, values projected, each
    in [B, heads, L, D], against the same steps taken with mlx-lm's own layer modules."""
    c = tiny_ckpt.config
    oracle = mlx_lm_model(tiny_ckpt).model.layers[0].self_attn
    attention, _ = _layer(impl, tiny_ckpt, 0)
    x = _hidden(tiny_ckpt, 2, 6, seed=3)
    q, k, v = attention.qkv(x, offset)

    def heads(y, n):  # [B, L, n * D] -> [B, n, L, D]
        return y.reshape(2, 6, n, c.head_dim).swapaxes(1, 2)

    want_q = oracle.rope(oracle.q_norm(heads(oracle.q_proj(x), c.num_attention_heads)), offset)
    want_k = oracle.rope(oracle.k_norm(heads(oracle.k_proj(x), c.num_key_value_heads)), offset)
    want_v = heads(oracle.v_proj(x), c.num_key_value_heads)
    _close(q, want_q, f"queries [B, H, L, D] at offset {offset}")
    _close(k, want_k, f"keys [B, H_kv, L, D] at offset {offset}")
    _close(v, want_v, "values [B, H_kv, L, D] (no RoPE, no norm)")


@pytest.mark.parametrize("length", [1, 9])
def test_attention_matches_mlx_lm(impl, tiny_ckpt, length):
    """Every layer's attention alone, on random input, against mlx-lm's Attention (no cache)."""
    oracle = mlx_lm_model(tiny_ckpt)
    mask = "causal" if length > 1 else None
    for i in range(tiny_ckpt.config.num_hidden_layers):
        attention, _ = _layer(impl, tiny_ckpt, i)
        x = _hidden(tiny_ckpt, 2, length, seed=10 + i)
        expected = oracle.model.layers[i].self_attn(x, mask=mask)
        _close(attention(x), expected, f"attention of layer {i}, L={length}")


def test_attention_is_causal(impl, tiny_gqa_ckpt):
    """Changing the last token must not change the outputs at earlier positions."""
    attention, _ = _layer(impl, tiny_gqa_ckpt, 0)
    x = _hidden(tiny_gqa_ckpt, 1, 6, seed=20)
    changed = mx.concatenate([x[:, :-1], x[:, -1:] + 5.0], axis=1)
    a, b = attention(x), attention(changed)
    _close(a[:, :-1], b[:, :-1], "earlier positions after changing the last token")
    assert not mx.allclose(a[:, -1], b[:, -1]).item(), "the last position ignored its own token"


# --- Task 2: the transformer block ------------------------------------------------------------


def test_transformer_block_matches_mlx_lm(impl, tiny_ckpt):
    oracle = mlx_lm_model(tiny_ckpt)
    for i in range(tiny_ckpt.config.num_hidden_layers):
        _, block = _layer(impl, tiny_ckpt, i)
        x = _hidden(tiny_ckpt, 2, 7, seed=30 + i)
        _close(block(x), oracle.model.layers[i](x, mask="causal"), f"block {i}")


# --- Task 3: the model ----------------------------------------------------------------------


@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
def test_model_logits_match_mlx_lm(impl, tiny_ckpt, prompt):
    model = impl.Qwen3ModelWeek1(tiny_ckpt)
    tokens = _tokens(tiny_ckpt, PROMPTS[prompt])
    logits = model(tokens)
    b, l = tokens.shape
    assert logits.shape == (b, l, tiny_ckpt.config.vocab_size), "logits: [B, L, vocab]"
    assert logits.dtype == mx.float32, "a float32 checkpoint gives float32 logits"
    _close(logits, mlx_lm_logits(tiny_ckpt, tokens), f"logits for {prompt!r}")


def test_model_on_a_chat_prompt(impl, tiny_ckpt):
    """A longer prompt with special tokens, as main.py will send it."""
    tok = tiny_ckpt.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Write a story about a cat."}])
    tokens = mx.array([tok.encode(text)], dtype=mx.int32)
    logits = impl.Qwen3ModelWeek1(tiny_ckpt)(tokens)
    _close(logits, mlx_lm_logits(tiny_ckpt, tokens), "logits for the chat prompt")


def test_model_prefix_logits_and_shape_checks(impl, tiny_gqa_ckpt):
    """Logits of a prefix do not depend on later tokens; a bad checkpoint is refused by name."""
    ckpt = tiny_gqa_ckpt
    tokens = _tokens(ckpt, ["The quick brown fox jumps over the lazy dog."])
    model = impl.Qwen3ModelWeek1(ckpt)
    full = model(tokens)
    _close(model(tokens[:, :5]), full[:, :5], "logits of the first 5 tokens alone")

    c = ckpt.config
    wrong = {
        "model.layers.1.self_attn.k_proj.weight": (
            c.num_attention_heads * c.head_dim,
            c.hidden_size,
        ),
        "model.layers.0.self_attn.q_norm.weight": (c.hidden_size,),
        "model.norm.weight": (c.hidden_size + 1,),
        "lm_head.weight": (c.vocab_size - 1, c.hidden_size),
    }
    for name, shape in wrong.items():
        weights = dict(ckpt.weights)
        weights[name] = mx.zeros(shape)
        with pytest.raises(ValueError, match=re.escape(name)):
            impl.Qwen3ModelWeek1(dataclasses.replace(ckpt, weights=weights))
    weights = dict(ckpt.weights)
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=re.escape("model.layers.1.mlp.down_proj.weight")):
        impl.Qwen3ModelWeek1(dataclasses.replace(ckpt, weights=weights))


def test_untied_model_uses_lm_head(impl, tiny_untied_ckpt):
    """With tie_word_embeddings false the output head is lm_head.weight, not the embedding."""
    ckpt = tiny_untied_ckpt
    assert not ckpt.config.tie_word_embeddings, "the test needs an untied checkpoint"
    tokens = _tokens(ckpt, ["Hello, world"])
    logits = impl.Qwen3ModelWeek1(ckpt)(tokens)
    weights = dict(ckpt.weights)
    weights["lm_head.weight"] = 2.0 * weights["lm_head.weight"]
    doubled = impl.Qwen3ModelWeek1(dataclasses.replace(ckpt, weights=weights))(tokens)
    _close(doubled, 2.0 * logits, "logits with lm_head.weight doubled")

"""Week 1 Day 5: the Qwen3 model without a cache (every call recomputes the whole sequence)."""

import mlx.core as mx

from tiny_llm_support import Checkpoint

from .attention import scaled_dot_product_attention_grouped
from .basics import linear
from .layer_norm import RMSNorm
from .mlp import Qwen3MLP
from .positional_encoding import RoPE


def take_weight(weights: dict[str, mx.array], name: str, shape: tuple[int, ...]) -> mx.array:
    """Fetch one checkpoint tensor and check its shape, naming it when something is wrong."""
    if name not in weights:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    w = weights[name]
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    return w


class Qwen3MultiHeadAttention:
    """Grouped-query attention with per-head RMSNorm on queries and keys (QK-norm) and RoPE."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        wq: mx.array,
        wk: mx.array,
        wv: mx.array,
        wo: mx.array,
        q_norm: mx.array,
        k_norm: mx.array,
        max_seq_len: int = 32768,
        theta: float = 1000000.0,
        rms_norm_eps: float = 1e-6,
    ):
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.q_norm = RMSNorm(head_dim, q_norm, rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, k_norm, rms_norm_eps)
        self.rope = RoPE(head_dim, max_seq_len, theta)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        b, l, _ = x.shape  # x [B, L, E]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(linear(x, self.wq).reshape(b, l, h, d))  # [B, L, H, D]
        k = self.k_norm(linear(x, self.wk).reshape(b, l, h_kv, d))  # [B, L, H_kv, D]
        v = linear(x, self.wv).reshape(b, l, h_kv, d)
        q = self.rope(q, offset).swapaxes(1, 2)  # [B, H, L, D]
        k = self.rope(k, offset).swapaxes(1, 2)  # [B, H_kv, L, D]
        v = v.swapaxes(1, 2)
        mask = "causal" if l > 1 else None
        out = scaled_dot_product_attention_grouped(q, k, v, mask=mask)  # [B, H, L, D]
        return linear(out.swapaxes(1, 2).reshape(b, l, h * d), self.wo)  # [B, L, E]


class Qwen3TransformerBlock:
    """x + attention(norm(x)), then + mlp(norm(...)): the pre-norm residual block."""

    def __init__(self, attention, mlp: Qwen3MLP, input_norm: RMSNorm, post_attention_norm: RMSNorm):
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = input_norm
        self.post_attention_layernorm = post_attention_norm

    def __call__(self, x: mx.array, *attention_args) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), *attention_args)
        return h + self.mlp(self.post_attention_layernorm(h))


def build_layer_parts(ckpt: Checkpoint, i: int) -> dict:
    """Checked weights of layer i, keyed by their role."""
    c = ckpt.config
    e, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    h, h_kv = c.num_attention_heads, c.num_key_value_heads
    p = f"model.layers.{i}."
    shapes = {
        "self_attn.q_proj.weight": (h * d, e),
        "self_attn.k_proj.weight": (h_kv * d, e),
        "self_attn.v_proj.weight": (h_kv * d, e),
        "self_attn.o_proj.weight": (e, h * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (inter, e),
        "mlp.up_proj.weight": (inter, e),
        "mlp.down_proj.weight": (e, inter),
        "input_layernorm.weight": (e,),
        "post_attention_layernorm.weight": (e,),
    }
    return {k: take_weight(ckpt.weights, p + k, s) for k, s in shapes.items()}


def build_block(ckpt: Checkpoint, i: int, attention_cls, max_seq_len: int) -> Qwen3TransformerBlock:
    """Layer i of the checkpoint, with the given attention class (with or without a cache)."""
    c = ckpt.config
    w = build_layer_parts(ckpt, i)
    attention = attention_cls(
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        w["self_attn.q_proj.weight"],
        w["self_attn.k_proj.weight"],
        w["self_attn.v_proj.weight"],
        w["self_attn.o_proj.weight"],
        w["self_attn.q_norm.weight"],
        w["self_attn.k_norm.weight"],
        max_seq_len=max_seq_len,
        theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
    )
    mlp = Qwen3MLP(
        c.hidden_size,
        c.intermediate_size,
        w["mlp.gate_proj.weight"],
        w["mlp.up_proj.weight"],
        w["mlp.down_proj.weight"],
    )
    return Qwen3TransformerBlock(
        attention,
        mlp,
        RMSNorm(c.hidden_size, w["input_layernorm.weight"], c.rms_norm_eps),
        RMSNorm(c.hidden_size, w["post_attention_layernorm.weight"], c.rms_norm_eps),
    )


class Qwen3ModelWeek1:
    """tokens [B, L] -> logits [B, L, vocab], recomputing the whole sequence each call."""

    def __init__(self, ckpt: Checkpoint):
        c = ckpt.config
        self.config = c
        self.num_hidden_layers = c.num_hidden_layers
        self.embed_tokens = take_weight(
            ckpt.weights, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)
        )
        self.layers = [
            build_block(ckpt, i, Qwen3MultiHeadAttention, c.max_position_embeddings)
            for i in range(c.num_hidden_layers)
        ]
        self.norm = RMSNorm(
            c.hidden_size,
            take_weight(ckpt.weights, "model.norm.weight", (c.hidden_size,)),
            c.rms_norm_eps,
        )
        self.lm_head = take_weight(ckpt.weights, "lm_head.weight", (c.vocab_size, c.hidden_size))

    def __call__(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens[tokens]  # [B, L, E]
        for layer in self.layers:
            h = layer(h)
        return linear(self.norm(h), self.lm_head)  # [B, L, V]

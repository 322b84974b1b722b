"""Week 1 Day 5: the Qwen3 model without a cache (every call recomputes the whole sequence)."""

import mlx.core as mx

from tiny_llm_support import Checkpoint, Qwen3Config, expected_shapes

from .attention import scaled_dot_product_attention_grouped
from .basics import linear
from .layer_norm import RMSNorm
from .mlp import Qwen3MLP
from .moe import Qwen3SparseMoE
from .positional_encoding import RoPE
from .quantize import QuantizedWeight, layer_weights


def take_weight(
    weights: dict[str, mx.array | QuantizedWeight], name: str, shape: tuple[int, ...]
) -> mx.array | QuantizedWeight:
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
        rope: RoPE | None = None,
    ):
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.q_norm = RMSNorm(head_dim, q_norm, rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, k_norm, rms_norm_eps)
        # a model passes one RoPE to all its layers: the tables depend only on the positions
        self.rope = rope or RoPE(head_dim, max_seq_len, theta)

    def qkv(
        self, x: mx.array, offset: int | list[int] | mx.array = 0
    ) -> tuple[mx.array, mx.array, mx.array]:
        """x [B, L, E] -> queries [B, H, L, D], keys and values [B, H_kv, L, D], rotated by
        their positions (offset as RoPE takes it)."""
        # BEGIN TASK Week 1 Day 5, Task 1: queries, keys and values with QK-norm and RoPE
        b, l, _ = x.shape  # x [B, L, E]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(linear(x, self.wq).reshape(b, l, h, d))  # [B, L, H, D]
        k = self.k_norm(linear(x, self.wk).reshape(b, l, h_kv, d))  # [B, L, H_kv, D]
        v = linear(x, self.wv).reshape(b, l, h_kv, d)
        q = self.rope(q, offset).swapaxes(1, 2)  # [B, H, L, D]
        k = self.rope(k, offset).swapaxes(1, 2)  # [B, H_kv, L, D]
        return q, k, v.swapaxes(1, 2)
        # END TASK

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        # BEGIN TASK Week 1 Day 5, Task 1: causal grouped-query attention over the whole sequence
        b, l, _ = x.shape  # x [B, L, E]
        q, k, v = self.qkv(x, offset)
        mask = "causal" if l > 1 else None
        out = scaled_dot_product_attention_grouped(q, k, v, mask=mask)  # [B, H, L, D]
        return linear(out.swapaxes(1, 2).reshape(b, l, -1), self.wo)  # [B, L, E]
        # END TASK


class Qwen3TransformerBlock:
    """x + attention(norm(x)), then + mlp(norm(...)): the pre-norm residual block."""

    def __init__(self, attention, mlp: Qwen3MLP, input_norm: RMSNorm, post_attention_norm: RMSNorm):
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = input_norm
        self.post_attention_layernorm = post_attention_norm

    def __call__(self, x: mx.array, *attention_args) -> mx.array:
        # BEGIN TASK Week 1 Day 5, Task 2: implement the transformer block
        h = x + self.self_attn(self.input_layernorm(x), *attention_args)
        return h + self.mlp(self.post_attention_layernorm(h))
        # END TASK


def checked_weights(
    ckpt: Checkpoint, quantized_linear: str | None = None
) -> dict[str, mx.array | QuantizedWeight]:
    """Every tensor the config calls for, each checked for its shape. A quantized layer (Week 4
    Day 1) comes as one QuantizedWeight, or dequantized, as `quantized_linear` says."""
    weights = layer_weights(ckpt, quantized_linear)
    shapes = expected_shapes(ckpt.config)
    return {name: take_weight(weights, name, shape) for name, shape in shapes.items()}


def build_block(
    c: Qwen3Config,
    w: dict[str, mx.array],
    i: int,
    attention_cls,
    rope: RoPE,
    block_cls=Qwen3TransformerBlock,
) -> Qwen3TransformerBlock:
    """Layer i from checked weights, with the given attention and block classes (with or
    without a cache)."""
    p = f"model.layers.{i}."
    attention = attention_cls(
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        w[p + "self_attn.q_proj.weight"],
        w[p + "self_attn.k_proj.weight"],
        w[p + "self_attn.v_proj.weight"],
        w[p + "self_attn.o_proj.weight"],
        w[p + "self_attn.q_norm.weight"],
        w[p + "self_attn.k_norm.weight"],
        max_seq_len=rope.seq_len,
        theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        rope=rope,
    )
    return block_cls(
        attention,
        build_mlp(c, w, i),
        RMSNorm(c.hidden_size, w[p + "input_layernorm.weight"], c.rms_norm_eps),
        RMSNorm(c.hidden_size, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps),
    )


def build_mlp(c: Qwen3Config, w: dict[str, mx.array], i: int) -> Qwen3MLP | Qwen3SparseMoE:
    """Layer i's feed-forward block: the dense SwiGLU, or in a sparse layer of a mixture of
    experts (Week 4 Day 6) the router and the stacked experts."""
    p = f"model.layers.{i}.mlp."
    if c.is_sparse(i):
        return Qwen3SparseMoE(
            c.num_experts_per_tok,
            c.norm_topk_prob,
            w[p + "gate.weight"],
            w[p + "switch_mlp.gate_proj.weight"],
            w[p + "switch_mlp.up_proj.weight"],
            w[p + "switch_mlp.down_proj.weight"],
        )
    return Qwen3MLP(
        c.hidden_size,
        c.intermediate_size,
        w[p + "gate_proj.weight"],
        w[p + "up_proj.weight"],
        w[p + "down_proj.weight"],
    )


class Qwen3ModelWeek1:
    """tokens [B, L] -> logits [B, L, vocab], recomputing the whole sequence each call.

    quantized_linear (Week 4 Day 1): how a quantized checkpoint's layers multiply, one of
    QUANTIZED_LINEAR_PATHS; None picks the faster one on the default device.
    """

    attention_cls = Qwen3MultiHeadAttention
    block_cls = Qwen3TransformerBlock
    honors_windows = False  # every layer attends to every earlier position

    def __init__(
        self,
        ckpt: Checkpoint,
        max_seq_len: int | None = None,
        quantized_linear: str | None = None,
    ):
        c = ckpt.config
        if c.layer_windows and not self.honors_windows:
            raise ValueError(
                f"{ckpt.path}: layers with a sliding window ({c.raw.get('sliding_window')} "
                f"positions) need Qwen3Model, whose caches honor it (Week 4 Day 7); "
                f"{type(self).__name__} would attend to every position"
            )
        w = checked_weights(ckpt, quantized_linear)
        self.config = c
        self.num_hidden_layers = c.num_hidden_layers
        self.max_seq_len = max_seq_len or c.max_position_embeddings
        self.embed_tokens = w["model.embed_tokens.weight"]  # [V, E]
        self.dtype = self.embed_tokens.dtype
        rope = RoPE(c.head_dim, self.max_seq_len, c.rope_theta)
        self.layers = [
            build_block(c, w, i, self.attention_cls, rope, self.block_cls)
            for i in range(c.num_hidden_layers)
        ]
        self.norm = RMSNorm(c.hidden_size, w["model.norm.weight"], c.rms_norm_eps)
        self.lm_head = w["lm_head.weight"]  # [V, E], the embedding itself when tied

    def __call__(self, tokens: mx.array) -> mx.array:
        # BEGIN TASK Week 1 Day 5, Task 3: implement the model forward pass
        h = self.embed_tokens[tokens]  # [B, L, E]
        for layer in self.layers:
            h = layer(h)
        return linear(self.norm(h), self.lm_head)  # [B, L, V]
        # END TASK

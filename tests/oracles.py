"""mlx-lm's Qwen3 with a checkpoint's weights: the oracle that day tests compare against.

    from oracles import mlx_lm_model, mlx_lm_logits, mlx_lm_greedy

The oracle is built once per Checkpoint object and kept for the session.
"""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.qwen3 import Model, ModelArgs

from tiny_llm_support import Checkpoint

_MODELS: dict[int, tuple[Checkpoint, Model]] = {}


def mlx_lm_args(ckpt: Checkpoint) -> ModelArgs:
    """mlx-lm's ModelArgs for a checkpoint's config."""
    c = ckpt.config
    return ModelArgs(
        model_type="qwen3",
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        vocab_size=c.vocab_size,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta,
        head_dim=c.head_dim,
        tie_word_embeddings=c.tie_word_embeddings,
    )


def mlx_lm_model(ckpt: Checkpoint) -> Model:
    """`mlx_lm.models.qwen3.Model` holding exactly the checkpoint's weights (cached)."""
    hit = _MODELS.get(id(ckpt))
    if hit is not None and hit[0] is ckpt:
        return hit[1]
    model = Model(mlx_lm_args(ckpt))
    weights = dict(ckpt.weights)
    if ckpt.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # mlx-lm reuses the embedding as the output head
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    _MODELS[id(ckpt)] = (ckpt, model)  # keeping ckpt alive keeps its id unique
    return model


def mlx_lm_logits(ckpt: Checkpoint, tokens: mx.array) -> mx.array:
    """tokens [B, L] -> logits [B, L, V], no cache, causal mask."""
    return mlx_lm_model(ckpt)(tokens)


def mlx_lm_greedy(ckpt: Checkpoint, prompt_tokens: list[int], n: int) -> list[int]:
    """n tokens of greedy decoding with mlx-lm's own KV cache (argmax at every step)."""
    model = mlx_lm_model(ckpt)
    cache = make_prompt_cache(model)
    inputs, out = mx.array([prompt_tokens]), []
    for _ in range(n):
        logits = model(inputs, cache=cache)[:, -1, :]  # [1, V]
        token = mx.argmax(logits, axis=-1).item()
        out.append(token)
        inputs = mx.array([[token]])
    return out

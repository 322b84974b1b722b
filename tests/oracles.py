"""mlx-lm's Qwen3 with a checkpoint's weights: the oracle that day tests compare against.

    from oracles import mlx_lm_model, mlx_lm_logits, mlx_lm_greedy

The oracle is built once per Checkpoint object and kept for the session.
"""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.qwen3 import Model

from tiny_llm_support import Checkpoint, mlx_lm_qwen3

_MODELS: dict[int, tuple[Checkpoint, Model]] = {}


def mlx_lm_model(ckpt: Checkpoint) -> Model:
    """`mlx_lm.models.qwen3.Model` holding exactly the checkpoint's weights (cached)."""
    hit = _MODELS.get(id(ckpt))
    if hit is not None and hit[0] is ckpt:
        return hit[1]
    model = mlx_lm_qwen3(ckpt)
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

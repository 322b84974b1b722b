"""Week 1 Day 6 (generation without a cache) and Week 2 Day 1 (with a KV cache)."""

from collections.abc import Iterator

import mlx.core as mx

from .qwen3 import Qwen3Model
from .qwen3_week1 import Qwen3ModelWeek1
from .sampler import Sampler, make_sampler


def _check_prompt(prompt_tokens: list[int], max_tokens: int) -> None:
    if not prompt_tokens:
        raise ValueError("the prompt has no tokens")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")


def simple_generate(
    model: Qwen3ModelWeek1,
    prompt_tokens: list[int],
    max_tokens: int = 32,
    sampler: Sampler | None = None,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
) -> Iterator[int]:
    """Yield up to max_tokens new tokens, running the whole sequence through the model each step."""
    # BEGIN TASK Week 1 Day 6, Task 1: implement the greedy generation loop
    _check_prompt(prompt_tokens, max_tokens)
    sampler = sampler or make_sampler()
    tokens = list(prompt_tokens)
    for _ in range(max_tokens):
        logits = model(mx.array([tokens]))  # [1, T, V]
        token = sampler(logits[:, -1, :]).item()
        yield token
        if token in eos_token_ids:
            return
        tokens.append(token)
    # END TASK


def simple_generate_with_kv_cache(
    model: Qwen3Model,
    prompt_tokens: list[int],
    max_tokens: int = 32,
    sampler: Sampler | None = None,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
) -> Iterator[int]:
    """The same tokens as simple_generate, but each step feeds only the newest token."""
    # BEGIN TASK Week 2 Day 1, Task 4: implement generation with a KV cache
    _check_prompt(prompt_tokens, max_tokens)
    sampler = sampler or make_sampler()
    cache = model.create_kv_cache()
    try:
        inputs, offset = list(prompt_tokens), 0
        for _ in range(max_tokens):
            logits = model(mx.array([inputs]), offset, cache, logits_to_keep=1)  # [1, 1, V]
            token = sampler(logits[:, -1, :]).item()
            yield token
            if token in eos_token_ids:
                return
            offset += len(inputs)
            inputs = [token]
    finally:
        for layer_cache in cache:
            layer_cache.release()
    # END TASK

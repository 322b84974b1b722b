"""Week 1 Day 6: turning logits into the next token."""

from collections.abc import Callable

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]


def make_sampler(
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> Sampler:
    """A function logits [B, V] -> token ids [B].

    temperature 0 is greedy (argmax). Otherwise logits are divided by the temperature,
    cut to the top_k largest and to the smallest set whose probability reaches top_p,
    and one token is drawn. A seed makes the draws reproducible.
    """
    raise NotImplementedError(
        "Week 1 Day 6, Task 2: implement the sampler (temperature, top-k, top-p)"
    )


def keep_top_p(scaled: mx.array, top_p: float) -> mx.array:
    """Mask every token outside the smallest most-likely set with probability >= top_p."""
    raise NotImplementedError("Week 1 Day 6, Task 2: implement top-p filtering")

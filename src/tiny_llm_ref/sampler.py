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
    # BEGIN TASK Week 1 Day 6, Task 2: implement the sampler (temperature, top-k, top-p)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    state = {"key": mx.random.key(seed) if seed is not None else None}

    def sample(logits: mx.array) -> mx.array:
        if temperature == 0:
            return mx.argmax(logits, axis=-1)
        scaled = logits.astype(mx.float32) / temperature  # [B, V]
        if top_k is not None and top_k < scaled.shape[-1]:
            kth = mx.sort(scaled, axis=-1)[:, -top_k][:, None]  # [B, 1]
            scaled = mx.where(scaled < kth, -mx.inf, scaled)
        if top_p is not None and top_p < 1.0:
            scaled = keep_top_p(scaled, top_p)
        key = None
        if state["key"] is not None:
            state["key"], key = mx.random.split(state["key"])
        return mx.random.categorical(scaled, axis=-1, key=key)

    return sample
    # END TASK


def keep_top_p(scaled: mx.array, top_p: float) -> mx.array:
    """Mask every token outside the smallest most-likely set with probability >= top_p."""
    # BEGIN TASK Week 1 Day 6, Task 2: implement top-p filtering
    order = mx.argsort(-scaled, axis=-1)  # [B, V], most likely first
    sorted_logits = mx.take_along_axis(scaled, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    keep_sorted = before < top_p  # the top token is always kept
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, scaled, -mx.inf)
    # END TASK

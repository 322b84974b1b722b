"""Week 4 Day 8: log-probabilities, what evaluators score answers with.

A client that asks for logprobs gets, for every token the engine generated, how likely the
model found it and which tokens it found most likely there. They come from the model's own
distribution: the log-softmax of the raw logits, before temperature, top-k and top-p (vLLM's
default, "raw logprobs"), so the same answer scores the same under any sampling settings. A
request under a grammar is scored after its mask: the tokens the grammar forbids have
probability 0 there (as in vLLM, whose grammar mask comes before its sampler).

Prompt logprobs (`echo` on /v1/completions, what lm-evaluation-harness sends) score every
prompt token given the ones before it: one more forward pass over the prompt, keeping every
row's logits instead of the last one's.
"""

from dataclasses import dataclass

import mlx.core as mx

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, and the `top` most likely tokens at its place, most
    likely first, as (token id, log-probability) pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: mx.array, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [N, V] and the token chosen after each row -> N TokenLogprobs, each with the k
    most likely tokens of its row (k = 0: none). Computed in float32 whatever the logits'
    dtype: a log-softmax in float16 loses the small probabilities evaluators compare."""
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"k must be in 0 .. {MAX_TOP_LOGPROBS}, got {k}")
    if len(tokens) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens)} tokens")
    raise NotImplementedError(
        "Week 4 Day 8, Task 1: the chosen token's log-probability and the top k of its row"
    )


def record_logprobs(logits: mx.array, requests: list, tokens: list[int]) -> None:
    """Row i of logits [N, V] chose tokens[i] for requests[i]: each request that asked for
    logprobs gets that token's TokenLogprob appended to its list."""
    for i, request in enumerate(requests):
        k = request.params.logprobs
        if k is not None:
            request.logprobs += token_logprobs(logits[i : i + 1], [tokens[i]], k)


def prompt_logprobs(model, prompt: list[int], k: int, chunk: int) -> list[TokenLogprob | None]:
    """Every prompt token's log-probability given the tokens before it (None for the first,
    which nothing predicts), from a forward pass over the prompt in chunks of `chunk` tokens on
    a cache of its own that is dropped afterwards."""
    cache = model.create_kv_cache()
    scored: list[TokenLogprob | None] = [None]
    for start in range(0, len(prompt) - 1, chunk):
        ids = prompt[start : start + chunk]
        logits = model(mx.array([ids]), start, cache)[0]  # [len(ids), V]
        following = prompt[start + 1 : start + 1 + len(ids)]  # the token after each row
        scored += token_logprobs(logits[: len(following)], following, k)
    return scored

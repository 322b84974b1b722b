"""Week 1 Day 6: turning logits into the next token. Week 4 Day 3: a batch whose requests
each sample with their own settings. Week 4 Day 8: rows under a grammar, and logprobs."""

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .logprobs import MAX_TOP_LOGPROBS, record_logprobs
from .structured_output import constrain

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


# --- Week 4 Day 3: each request of a batch with its own settings ------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How one served request picks its tokens and when it stops.

    max_tokens bounds the generated tokens (None: only max_seq_len does); temperature 0 is
    greedy; top_k / top_p / seed as for make_sampler; generation stops at the first of the
    `stop` strings (which is not part of the text), or at EOS unless ignore_eos.
    logprobs (Week 4 Day 8): None for none, else each token's log-probability with the
    `logprobs` most likely tokens at its place; grammar: an llguidance grammar the text must
    follow (None: free text).
    """

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> None:
        """A ValueError naming the first setting out of range."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in 0 .. 2**64 - 1, got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(self.stop)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0 .. {MAX_TOP_LOGPROBS}, got {self.logprobs}")

    def sampler(self) -> Sampler | None:
        """A sampler of its own for a request (None when greedy): it keeps the request's own
        random key, so a seeded request draws the same tokens alone or in any batch."""
        if self.greedy:
            return None
        return make_sampler(self.temperature, self.top_k, self.top_p, self.seed)


def pick_tokens(logits: mx.array, requests: list) -> list[int]:
    """logits [B, V], row i for requests[i] -> the next token of each request. A batch of
    greedy requests is one argmax; any other goes row by row (sample_rows). Rows of requests
    under a grammar are masked first, and requests that asked for logprobs record their
    token's (Week 4 Day 8)."""
    if any(r.grammar is not None for r in requests):
        logits = constrain(logits, requests)
    if all(r.sampler is None for r in requests):
        tokens = mx.argmax(logits, axis=-1).tolist()
    else:
        tokens = sample_rows(logits, requests)
    record_logprobs(logits, requests, tokens)
    return tokens


def sample_rows(logits: mx.array, requests: list) -> list[int]:
    """Row i drawn with requests[i].sampler, its own settings and key; a request whose
    sampler is None (temperature 0) gets exactly the argmax of its row."""
    # BEGIN TASK Week 4 Day 3, Task 2: sample each row with its own request's sampler
    greedy = mx.argmax(logits, axis=-1)  # [B]
    picked = []
    for i, request in enumerate(requests):
        if request.sampler is None:
            picked.append(greedy[i].item())
        else:
            picked.append(request.sampler(logits[i : i + 1]).item())  # [1, V] -> [1]
    return picked
    # END TASK

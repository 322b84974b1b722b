"""Week 3 Day 1 (continuous batching) and Week 3 Day 2 (chunked prefill).

The scheduler loop of batch_generate, each iteration:
  admit a waiting prompt when a slot is free and nothing is being prefilled,
  prefill at most prefill_step tokens of the prompt being prefilled,
  decode one token for every request in a slot,
until the queue, the prefill and the slots are all empty.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from tiny_llm_support import Tokenizer

from .batching_kv_cache import BatchingKvCache
from .paged_kv_cache import TinyKvPagedPool
from .qwen3 import Qwen3Model


class Request:
    """One prompt on its way through prefill and decode, with its own per-layer caches."""

    def __init__(
        self,
        model: Qwen3Model,
        tokenizer: Tokenizer,
        prompt: str,
        prefill_max_step: int = 128,
        prompt_idx: int = 0,
        max_seq_len: int | None = None,
        pools: list[TinyKvPagedPool] | None = None,
    ):
        if prefill_max_step < 1:
            raise ValueError(f"prefill_max_step must be >= 1, got {prefill_max_step}")
        tokens = tokenizer.encode(prompt)
        if not tokens:
            raise ValueError(f"prompt {prompt_idx} has no tokens")
        if max_seq_len is not None and len(tokens) > max_seq_len:
            raise ValueError(
                f"prompt {prompt_idx} has {len(tokens)} tokens, more than max_seq_len={max_seq_len}"
            )
        self.model = model
        self.prompt_idx = prompt_idx
        self.prompt_tokens = tokens
        self.prefill_max_step = prefill_max_step
        self.max_seq_len = max_seq_len
        self.eos_token_ids = tokenizer.eos_token_ids
        self.detokenizer = tokenizer.detokenizer()
        self.generated: list[int] = []
        self.offset = 0  # tokens in the cache
        self.is_prefill_done = False
        self.is_done = False
        if pools is None:
            self.kv_cache = model.create_kv_cache()
        else:
            self.kv_cache = model.create_paged_kv_cache(pools)

    @property
    def num_prefill_chunks(self) -> int:
        return -(-len(self.prompt_tokens) // self.prefill_max_step)

    def try_prefill(self) -> None:
        """Run the next slice of at most prefill_max_step prompt tokens at its absolute offset."""
        raise NotImplementedError("Week 3 Day 1, Task 3: prefill the prompt (Week 3 Day 2, Task 1 makes it chunked)")

    def decode_done(self, token: int) -> None:
        """The last accepted token is now in the cache; `token` is the next one."""
        raise NotImplementedError("Week 3 Day 1, Task 4: accept a decoded token")

    def _accept(self, token: int) -> None:
        raise NotImplementedError("Week 3 Day 1, Task 4: record a token and decide whether the request is done")

    def text(self) -> str:
        return self.detokenizer.text

    def release(self) -> None:
        for layer_cache in self.kv_cache:
            layer_cache.release()


@dataclass
class BatchStep:
    """What one scheduler iteration did, for progress views and measurements."""

    kind: str  # "prefill", "decode" or "finish"
    request: Request | None  # the prefilled or finished request
    slots: list[Request | None]


def _check_limits(max_seq_len: int, batch_size: int, prefill_step: int) -> None:
    for name, value in [
        ("max_seq_len", max_seq_len),
        ("batch_size", batch_size),
        ("prefill_step", prefill_step),
    ]:
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def batch_generate(
    model: Qwen3Model,
    tokenizer: Tokenizer,
    prompts: list[str],
    max_seq_len: int = 512,
    batch_size: int = 5,
    prefill_step: int = 128,
    pools: list[TinyKvPagedPool] | None = None,
    on_step: Callable[[BatchStep], None] | None = None,
) -> list[tuple[int, str]]:
    """Greedy-decode every prompt with continuous batching; returns (prompt_idx, text) in order."""
    raise NotImplementedError("Week 3 Day 1, Task 5: the continuous-batching scheduler loop")


def _decode_step(
    model: Qwen3Model,
    slots: list[Request | None],
    batch_cache: list[BatchingKvCache],
    finish: Callable[[Request], None],
) -> None:
    """One token for every active request, in one batched forward pass."""
    raise NotImplementedError("Week 3 Day 1, Task 5: one batched decode step")

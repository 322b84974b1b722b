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
        if self.is_prefill_done:
            raise ValueError(f"request {self.prompt_idx} is already prefilled")
        start = self.offset
        chunk = self.prompt_tokens[start : start + self.prefill_max_step]
        logits = self.model(mx.array([chunk]), start, self.kv_cache, logits_to_keep=1)
        for layer_cache in self.kv_cache:
            layer_cache.materialize()  # keep the lazy graph from growing across chunks
        self.offset = start + len(chunk)
        if self.offset == len(self.prompt_tokens):
            self.is_prefill_done = True
            self._accept(mx.argmax(logits[0, -1]).item())

    def decode_done(self, token: int) -> None:
        """The last accepted token is now in the cache; `token` is the next one."""
        self.offset += 1
        self._accept(token)

    def _accept(self, token: int) -> None:
        self.generated.append(token)
        self.detokenizer.add_token(token)
        total = len(self.prompt_tokens) + len(self.generated)
        if token in self.eos_token_ids or (self.max_seq_len and total >= self.max_seq_len):
            self.is_done = True
            self.detokenizer.finalize()

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
    _check_limits(max_seq_len, batch_size, prefill_step)
    for idx, prompt in enumerate(prompts):  # every prompt is checked before any cache exists
        n = len(tokenizer.encode(prompt))
        if n == 0 or n > max_seq_len:
            raise ValueError(f"prompt {idx} has {n} tokens; it needs 1..max_seq_len={max_seq_len}")
    report = on_step or (lambda step: None)
    pending = deque(enumerate(prompts))
    slots: list[Request | None] = [None] * batch_size
    batch_cache = [BatchingKvCache(batch_size) for _ in range(model.num_hidden_layers)]
    prefilling: Request | None = None
    results: dict[int, str] = {}

    def finish(request: Request) -> None:
        request.release()
        results[request.prompt_idx] = request.text()
        report(BatchStep("finish", request, slots))

    try:
        while pending or prefilling or any(slots):
            if prefilling is None and pending and None in slots:
                idx, prompt = pending.popleft()
                prefilling = Request(
                    model, tokenizer, prompt, prefill_step, idx, max_seq_len, pools
                )
            if prefilling is not None:
                prefilling.try_prefill()
                report(BatchStep("prefill", prefilling, slots))
                if prefilling.is_prefill_done:
                    if prefilling.is_done:
                        finish(prefilling)
                    else:
                        slot = slots.index(None)
                        slots[slot] = prefilling
                        for layer_cache, request_cache in zip(batch_cache, prefilling.kv_cache):
                            layer_cache.add_request(request_cache, slot)
                    prefilling = None
            if any(slots):
                _decode_step(model, slots, batch_cache, finish)
                report(BatchStep("decode", None, slots))
    finally:
        for layer_cache in batch_cache:
            layer_cache.release()  # releases the caches of requests still in a slot
        if prefilling is not None:
            prefilling.release()
    return sorted(results.items())


def _decode_step(
    model: Qwen3Model,
    slots: list[Request | None],
    batch_cache: list[BatchingKvCache],
    finish: Callable[[Request], None],
) -> None:
    """One token for every active request, in one batched forward pass."""
    active = [i for i, r in enumerate(slots) if r is not None]
    tokens = mx.array([[slots[i].generated[-1]] for i in active])  # [B, 1]
    offsets = [slots[i].offset for i in active]
    logits = model(tokens, offsets, batch_cache)  # [B, 1, V]
    next_tokens = mx.argmax(logits[:, -1, :], axis=-1).tolist()
    for i, token in zip(active, next_tokens):
        request = slots[i]
        request.decode_done(token)
        if request.is_done:
            for layer_cache in batch_cache:
                layer_cache.remove_request(i)
            slots[i] = None
            finish(request)

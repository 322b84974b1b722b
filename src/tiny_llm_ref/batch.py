"""Week 3 Day 1 (continuous batching), Day 2 (chunked prefill) and Day 3 (query padding); Week 4
Day 3 takes a request out from wherever it is (Scheduler.remove).

The Engine (engine.py) runs a Scheduler one iteration at a time. One iteration of the "alternate"
policy (Scheduler.alternate_step):
  admit a waiting prompt when a slot is free and nothing is being prefilled,
  prefill at most prefill_step tokens of the prompt being prefilled,
  decode one token for every request in a slot.
The "hybrid" policy of Week 3 Day 4 (stall_free.hybrid_step) puts both into one forward pass.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from tiny_llm_support import Tokenizer

from .batching_kv_cache import BatchingKvCache
from .memory_planning import can_admit, free_pages, make_room, pages_for
from .paged_kv_cache import TinyKvPagedPool
from .qwen3 import Qwen3Model
from .sampler import SamplingParams, pick_tokens
from .shape_stable import Ladder, query_ladder


class Request:
    """One prompt on its way through prefill and decode, with its own per-layer caches.

    `prompt` is text (encoded here) or a list of token ids. A request is done at an EOS token
    (unless ignore_eos), after max_new_tokens generated tokens, or when prompt plus generated
    tokens reach max_seq_len, whichever comes first. prefill_max_step is the chunk budget,
    the same setting as batch_generate's prefill_step. query_padding (Week 3 Day 3) pads each
    chunk to a width of prefill_query_width's ladder (True), of a ladder function given here,
    or not at all (False); None means padding exactly when the model runs compiled.
    `sampling` (Week 4 Day 3) picks its tokens: greedy unless it says otherwise.
    """

    def __init__(
        self,
        model: Qwen3Model,
        tokenizer: Tokenizer,
        prompt: str | list[int],
        prefill_max_step: int = 128,
        prompt_idx: int = 0,
        max_seq_len: int | None = None,
        pools: list[TinyKvPagedPool] | None = None,
        max_new_tokens: int | None = None,
        ignore_eos: bool = False,
        query_padding: bool | Ladder | None = None,
        sampling: SamplingParams | None = None,
    ):
        if prefill_max_step < 1:
            raise ValueError(f"prefill_max_step must be >= 1, got {prefill_max_step}")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {max_new_tokens}")
        tokens = prompt_tokens(tokenizer, prompt, model.config.vocab_size, prompt_idx)
        if max_seq_len is not None and len(tokens) > max_seq_len:
            raise ValueError(
                f"prompt {prompt_idx} has {len(tokens)} tokens, more than max_seq_len={max_seq_len}"
            )
        self.model = model
        self.prompt_idx = prompt_idx
        self.prompt_tokens = tokens
        self.prefill_max_step = prefill_max_step
        self.max_seq_len = max_seq_len
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset() if ignore_eos else frozenset(tokenizer.eos_token_ids)
        self.detokenizer = tokenizer.detokenizer()
        self.generated: list[int] = []
        self.offset = 0  # tokens in the cache
        self.is_prefill_done = False
        self.is_done = False
        self.query_width = query_ladder(model, query_padding)
        self.pools = pools
        self.admitted = 0  # when the scheduler admitted it last (Week 3 Day 6)
        self.sampler = (sampling or SamplingParams()).sampler()  # None: greedy (Week 4 Day 3)
        if pools is None:
            self.kv_cache = model.create_kv_cache()
        else:
            self.kv_cache = model.create_paged_kv_cache(pools)

    @property
    def num_prefill_chunks(self) -> int:
        return -(-len(self.prompt_tokens) // self.prefill_max_step)

    @property
    def prefill_tokens(self) -> list[int]:
        """What prefill puts in the cache: the prompt, and after a preemption (Week 3 Day 6)
        also every generated token but the last, which is the next decode step's input."""
        return self.prompt_tokens + self.generated[:-1]

    @property
    def longest(self) -> int:
        """The most tokens this request can ever hold in its cache."""
        limit = self.model.max_seq_len if self.max_seq_len is None else self.max_seq_len
        if self.max_new_tokens is not None:
            limit = min(limit, len(self.prompt_tokens) + self.max_new_tokens)
        return limit

    def try_prefill(self) -> None:
        """Run the next slice of at most prefill_max_step prompt tokens at its absolute offset."""
        # BEGIN TASK Week 3 Day 1, Task 3 and Week 3 Day 2, Task 1: prefill the prompt in chunks
        if self.is_prefill_done:
            raise ValueError(f"request {self.prompt_idx} is already prefilled")
        chunk = self.prefill_tokens[self.offset : self.offset + self.prefill_max_step]
        logits = self.forward_chunk(chunk)  # [V], the chunk's last token
        self.materialize()  # keep the lazy graph from growing across chunks
        if self.chunk_done(len(chunk)):
            self.accept(pick_tokens(logits[None], [self])[0])
        # END TASK

    def chunk_done(self, n: int) -> bool:
        """n more prefill tokens are in the cache. True when that completes a fresh prompt,
        whose last logits then give the first generated token (a request resumed after a
        preemption already holds its next token)."""
        self.offset += n
        self.is_prefill_done = self.offset == len(self.prefill_tokens)
        return self.is_prefill_done and not self.generated

    def materialize(self) -> None:
        for layer_cache in self.kv_cache:
            layer_cache.materialize()

    def forward_chunk(self, chunk: list[int]) -> mx.array:
        """Run `chunk` at the request's offset and return the logits [V] of its last token.

        With query padding the chunk is widened to self.query_width(rows, prefill_max_step)
        rows by repeating its last token; the padded rows come after every real row, their logits are dropped and
        the cache is rewound past them. A model that returns fewer rows than it was asked for
        has contracted the query axis: padding is switched off for it and the chunk re-run.
        """
        start, rows = self.offset, len(chunk)
        width = self.padded_width(rows)
        if width > rows:
            # BEGIN TASK Week 3 Day 3, Task 4: run the padded chunk, keep the last real row, rewind
            keep = width - rows + 1  # the last real row and the padded rows after it
            padded = chunk + [chunk[-1]] * (width - rows)
            logits = self.model(mx.array([padded]), start, self.kv_cache, logits_to_keep=keep)
            rows_kept = logits.shape[1] == keep
            for layer_cache in self.kv_cache:
                layer_cache.rewind(start + rows if rows_kept else start)
            if rows_kept:
                return logits[0, 0]
            self.model.query_padding_ok = False  # rows were lost: never pad this model again
            # END TASK
        logits = self.model(mx.array([chunk]), start, self.kv_cache, logits_to_keep=1)
        return logits[0, -1]

    def padded_width(self, rows: int) -> int:
        """The width to run a chunk of `rows` rows at: its ladder width when padding is on
        and the padded rows fit in the model's positions and in the free pages, else rows."""
        if self.query_width is None or not getattr(self.model, "query_padding_ok", True):
            return rows
        width = self.query_width(rows, self.prefill_max_step)
        fits = self.offset + width <= self.model.max_seq_len
        return width if fits and pages_for(self, width) <= free_pages(self.pools) else rows

    def preempt(self) -> None:
        """Give every page back and start over: the generated tokens are kept, and the next
        prefill recomputes the cache from prefill_tokens."""
        # BEGIN TASK Week 3 Day 6, Task 2: give the cache back, keep the generated tokens
        self.release()
        self.offset = 0
        self.is_prefill_done = False
        # END TASK

    def decode_done(self, token: int) -> None:
        """The last accepted token is now in the cache; `token` is the next one."""
        # BEGIN TASK Week 3 Day 1, Task 4: accept a decoded token
        self.offset += 1
        self.accept(token)
        # END TASK

    def accept(self, token: int) -> None:
        """Record a generated token and decide whether the request is done."""
        # BEGIN TASK Week 3 Day 1, Task 4: record a token, stop at EOS or at a length limit
        self.generated.append(token)
        self.detokenizer.add_token(token)
        total = len(self.prompt_tokens) + len(self.generated)
        if (
            token in self.eos_token_ids
            or (self.max_new_tokens is not None and len(self.generated) >= self.max_new_tokens)
            or (self.max_seq_len is not None and total >= self.max_seq_len)
        ):
            self.is_done = True
            self.detokenizer.finalize()
        # END TASK

    def text(self) -> str:
        return self.detokenizer.text

    def release(self) -> None:
        for layer_cache in self.kv_cache:
            layer_cache.release()


def prompt_tokens(
    tokenizer: Tokenizer, prompt: str | list[int], vocab_size: int, prompt_idx: int = 0
) -> list[int]:
    """The token ids of a prompt given as text or as ids; an empty prompt or an id outside the
    vocabulary is an error naming the prompt."""
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt)
    else:
        tokens = list(prompt)
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {prompt_idx} has token ids outside 0..{vocab_size - 1}: {bad[:5]}"
            )
    if not tokens:
        raise ValueError(f"prompt {prompt_idx} has no tokens")
    return tokens


@dataclass
class BatchStep:
    """What one scheduler event did, for progress views and measurements.

    kind "prefill": a chunk of `tokens` prompt rows ran for `request`; "decode": every
    decoding request got one token (`tokens` rows); "finish": `request` is done and released.
    With a bounded page pool (Week 3 Day 6) also "admit", "wait" (the next prompt waits for
    pages), "preempt" (`request` gave its pages back) and "refuse" (`request` can never fit;
    `detail` says why). `slots` is a copy of the slot list at the moment of the event;
    `forward_pass` counts the model calls of the call, so events of one pass share it.
    """

    kind: str
    request: Request | None
    slots: list[Request | None]
    tokens: int = 0
    forward_pass: int = 0
    detail: str = ""


class Scheduler:
    """What the engine keeps from iteration to iteration, for either policy: the requests
    still waiting (new, or preempted), the slots, the request being prefilled outside the
    slots (the alternate policy), the page pools, and a count of forward passes and
    admissions."""

    def __init__(
        self,
        model: Qwen3Model,
        batch_size: int,
        pools: list[TinyKvPagedPool] | None = None,
        on_step: Callable[[BatchStep], None] | None = None,
    ):
        self.model = model
        self.pending: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * batch_size
        self.prefilling: Request | None = None
        self.batch_cache = [BatchingKvCache(batch_size) for _ in range(model.num_hidden_layers)]
        self.pools = pools
        self.passes = self.admissions = 0
        self.waiting: Request | None = None  # the prompt last reported as waiting for pages
        self.on_step = on_step

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.prefilling or any(self.slots))

    def report(self, kind: str, request: Request | None = None, tokens: int = 0, detail="") -> None:
        if self.on_step is not None:
            slots = list(self.slots)
            self.on_step(BatchStep(kind, request, slots, tokens, self.passes, detail))

    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def owed(self) -> int:
        """Pages that admitted prompts still need to finish their prefill."""
        prefilling = [r for r in [*self.slots, self.prefilling] if r and not r.is_prefill_done]
        return sum(pages_for(r, len(r.prefill_tokens) - r.offset) for r in prefilling)

    def admit(self) -> Request | None:
        """The next waiting request, or None while it does not fit the pool (it waits; the
        engine refused any request that could never fit before queueing it)."""
        if self.pending:
            request = self.pending[0]
            alone = self.prefilling is None and not any(self.slots)  # headroom is for others
            if not alone and not can_admit(len(request.prefill_tokens), self.owed(), self.pools):
                if self.waiting is not request:
                    self.waiting = request
                    self.report("wait", request)
                return None
            self.pending.popleft()
            self.admissions += 1
            request.admitted = self.admissions
            self.report("admit", request)
            return request
        return None

    def preempt(self, request: Request) -> None:
        """Take a running request out of its slot, free its pages and queue it first."""
        self.vacate(self.slots.index(request))
        request.preempt()
        self.pending.appendleft(request)
        self.report("preempt", request)

    def vacate(self, slot: int) -> None:
        """Empty a slot, and the batch caches' row of it if the request had reached them (a
        request still being prefilled under the hybrid policy has not)."""
        self.slots[slot] = None
        for layer_cache in self.batch_cache:
            if layer_cache.slots[slot] is not None:
                layer_cache.remove_request(slot)

    def remove(self, request: Request) -> bool:
        """Take `request` out wherever it is (waiting, preempted, being prefilled, decoding)
        and give its slot and pages back at once. False if the scheduler does not hold it."""
        # BEGIN TASK Week 4 Day 3, Task 1: take a request out from any state
        if any(r is request for r in self.pending):
            self.pending.remove(request)
            if self.waiting is request:
                self.waiting = None
        elif self.prefilling is request:
            self.prefilling = None
        elif any(r is request for r in self.slots):
            self.vacate(self.slots.index(request))
        else:
            return False
        request.release()
        return True
        # END TASK

    def finish(self, request: Request) -> None:
        request.release()
        self.report("finish", request)

    def release(self) -> None:
        """Return every cache still held: the slots' requests and the one being prefilled."""
        for layer_cache in self.batch_cache:
            layer_cache.release()  # releases the caches of the requests it batches
        for request in [*self.slots, self.prefilling]:
            if request is not None:
                request.release()

    def alternate_step(self) -> None:
        """One iteration: admit, prefill one chunk, then one batched decode step."""
        # BEGIN TASK Week 3 Day 1, Task 5: one iteration of the continuous-batching loop
        if self.prefilling is None and self.pending and None in self.slots:
            self.prefilling = self.admit()
        request = self.prefilling
        if request is not None and self.chunk_fits(request):
            before = request.offset
            request.try_prefill()
            self.passes += 1
            self.report("prefill", request, request.offset - before)
            if request.is_prefill_done:
                self.prefilling = None
                if request.is_done:
                    self.finish(request)
                else:
                    slot = self.slots.index(None)
                    self.slots[slot] = request
                    for layer_cache, request_cache in zip(self.batch_cache, request.kv_cache):
                        layer_cache.add_request(request_cache, slot)
        make_room(self, lambda: sum(pages_for(r, 1) for r in self.running()))  # decode first
        if any(self.slots):
            rows = len(self.running())
            self.passes += 1
            decode_step(self.model, self.slots, self.batch_cache, self.finish)
            self.report("decode", None, rows)
        # END TASK

    def chunk_fits(self, request: Request) -> bool:
        """Whether the pages of the request's next chunk are free (a chunk never preempts)."""
        rows = min(request.prefill_max_step, len(request.prefill_tokens) - request.offset)
        return pages_for(request, rows) <= free_pages(self.pools)


def decode_step(
    model: Qwen3Model,
    slots: list[Request | None],
    batch_cache: list[BatchingKvCache],
    finish: Callable[[Request], None],
) -> None:
    """One token for every active request, in one batched forward pass."""
    # BEGIN TASK Week 3 Day 1, Task 5: one batched decode step
    active = [i for i, r in enumerate(slots) if r is not None]
    tokens = mx.array([[slots[i].generated[-1]] for i in active])  # [B, 1]
    offsets = [slots[i].offset for i in active]
    logits = model(tokens, offsets, batch_cache)  # [B, 1, V]
    next_tokens = pick_tokens(logits[:, -1, :], [slots[i] for i in active])
    for i, token in zip(active, next_tokens):
        request = slots[i]
        request.decode_done(token)
        if request.is_done:
            for layer_cache in batch_cache:
                layer_cache.remove_request(i)
            slots[i] = None
            finish(request)
    # END TASK

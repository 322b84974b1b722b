"""Week 3 Day 1 (continuous batching) and Day 6 (memory planning); Week 4 Day 3 takes a
request out from wherever it is (Scheduler.remove).

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

from .batching_kv_cache import BatchingKvCache
from .fork import can_fork, fork_prefix
from .memory_planning import can_admit, free_pages, make_room, pages_for
from .paged_kv_cache import TinyKvPagedPool
from .prefix_cache import reuse_prefix, shares_prefix, tokens_to_admit
from .qwen3 import Qwen3Model
from .request import Request
from .sampler import pick_tokens


@dataclass
class BatchStep:
    """What one scheduler event did, for progress views and measurements.

    kind "prefill": a chunk of `tokens` prompt rows ran for `request`; "decode": every
    decoding request got one token (`tokens` rows); "finish": `request` is done and released.
    With a bounded page pool (Week 3 Day 6) also "admit", "wait" (the next prompt waits for
    pages), "preempt" (`request` gave its pages back) and "refuse" (`request` can never fit;
    `detail` says why). `slots` is a copy of the slot list at the moment of the event;
    `forward_pass` counts the model calls so far: "prefill", "decode" and "finish" come after
    their pass and carry its number, so the events of one pass share it; "admit", "wait",
    "preempt" and "refuse" come while the next pass is planned and carry the number of the
    last pass run (the views add one to place them in the pass they prepare).
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
        engine refused any request that could never fit before queueing it). With a prefix
        cache (Week 4 Day 4) its page tables start with the cached pages of its prompt; the
        "admit" event's `tokens` counts the tokens they hold. A fork (Week 4 Day 8) waits
        while its parent prefills the prompt, then starts from the parent's pages."""
        if self.pending:
            request = self.pending[0]
            parent = request.fork_of
            if parent is not None and not parent.is_prefill_done and self.holds(parent):
                return None
            alone = self.prefilling is None and not any(self.slots)  # headroom is for others
            if not alone and not can_admit(
                tokens_to_admit(request), self.reserved(request), self.pools
            ):
                if self.waiting is not request:
                    self.waiting = request
                    self.report("wait", request)
                return None
            self.pending.popleft()
            first = request.admitted == 0
            self.admissions += 1
            request.admitted = self.admissions
            if can_fork(request, request.fork_of):
                cached = fork_prefix(request, request.fork_of)
            else:
                cached = reuse_prefix(request) if shares_prefix(request) else 0
            if cached >= len(request.prefill_tokens):
                raise RuntimeError(
                    f"reuse_prefix found all {cached} prompt tokens cached: match at most "
                    "len(prompt) - 1 tokens, since the last one is always computed (its logits "
                    "give the next token)"
                )
            if first:
                request.cached_tokens = cached
            self.report("admit", request, cached)
            return request
        return None

    def holds(self, request: Request) -> bool:
        """Whether `request` is waiting, being prefilled or in a slot."""
        return any(r is request for r in [*self.pending, self.prefilling, *self.slots])

    def reserved(self, request: Request) -> int:
        """Pages an admission must leave free: those owed to prompts being prefilled and, when
        admission itself takes cached pages off the LRU (a prefix cache), the pages this
        iteration's decode rows will take."""
        owed = self.owed()
        if shares_prefix(request):
            owed += sum(pages_for(r, 1) for r in self.running() if r.is_prefill_done)
        return owed

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
        raise NotImplementedError("Week 4 Day 3, Task 1: take a request out from any state")

    def finish(self, request: Request) -> None:
        request.release()
        self.report("finish", request)

    def release(self) -> None:
        """Return every cache still held (the slots' requests, the one being prefilled) and
        forget every request, waiting ones included."""
        for layer_cache in self.batch_cache:
            layer_cache.release()  # releases the caches of the requests it batches
        for request in [*self.slots, self.prefilling]:
            if request is not None:
                request.release()
        self.pending.clear()
        self.prefilling = self.waiting = None
        self.slots = [None] * len(self.slots)

    def alternate_step(self) -> None:
        """One iteration: admit, prefill one chunk, then one batched decode step."""
        raise NotImplementedError(
            "Week 3 Day 1, Task 5: one iteration of the continuous-batching loop"
        )

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
    raise NotImplementedError("Week 3 Day 1, Task 5: one batched decode step")

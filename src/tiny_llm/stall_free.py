"""Week 3 Day 4: stall-free batching (the "hybrid" policy of batch_generate).

Every iteration is one forward pass over a ragged batch: one row for every request that is
decoding, then as many prompt tokens as the token budget leaves. The rows of all requests sit
side by side in tokens [1, T]; the linear layers, norms and the MLP run over all T rows at
once, reading each weight once per pass, and attention runs per segment against that
request's own cache.
"""

import math
from dataclasses import dataclass

import mlx.core as mx

from .basics import linear
from .flash_attention import paged_attention
from .memory_planning import free_pages, make_room, pages_for
from .qwen3 import attention_mask
from .sampler import pick_tokens
from .shape_stable import Ladder


@dataclass
class Segment:
    """`length` consecutive rows of a ragged batch, starting at row `start`, that belong to
    the request whose per-layer caches are `cache` (they continue at its cache offset)."""

    cache: list
    start: int
    length: int


def forward_ragged(
    model, tokens: mx.array, segments: list[Segment], rows: list[int] | None = None
) -> mx.array:
    """tokens [1, T]: the segments' rows side by side, then any padding rows.

    Returns the logits [1, len(segments), V] of each segment's last row, or with `rows` the
    logits [1, len(rows), V] of those rows (Week 4 Day 5 checks every row of a draft). Padding
    rows (after the last segment) take part in the token-parallel halves only: they attend to
    nothing, are written to no cache, and their logits are never computed.

    Over a page pool read in place, each layer writes every segment's new keys/values in one
    scatter and attends with one paged_attention call per segment length (all decode rows in
    one); any other cache attends segment by segment.
    """
    raise NotImplementedError(
        "Week 3 Day 4, Task 1: one forward pass over the rows of several requests"
    )


def rows_of(seg: Segment) -> slice:
    """The rows of the ragged batch that belong to the segment."""
    return slice(seg.start, seg.start + seg.length)


def attend_in_place(
    q: mx.array, k: mx.array, v: mx.array, segments: list[Segment], caches: list
) -> list[mx.array]:
    """q [1, H, T, D], k/v [1, H_kv, T, D] of one layer; caches: each segment's cache of that
    layer, all over one pool read in place. Writes every segment's new keys/values into the
    pool in one scatter per storage array, then attends -> one [1, H, length, D] per segment.

    All writes come before any read: a write while an earlier read of the pool is pending
    cannot reuse the pool's buffer, so MLX would copy the whole pool for it."""
    raise NotImplementedError(
        "Week 3 Day 5, Task 5: write the whole pass, then attend over the pages"
    )


def plan_pass(scheduler, budget: int, propose=None) -> tuple[list, list]:
    """The requests that decode in this pass, and (request, tokens) chunks that fill what the
    budget leaves: first the prompt already being prefilled, then, while rows and free slots
    remain, newly admitted prompts, each taking its slot as it is admitted. With a bounded
    pool the decode rows get their pages first (preempting the newest requests if need be),
    and each chunk takes only pages that are still spare: free, and not already promised to
    a decode row or to an earlier chunk of this pass (nothing is allocated until the pass
    runs, so the plan keeps the count).

    propose(request, most) (Week 4 Day 5) gives each decoding request at most `most` proposed
    tokens, kept in request.draft (a Draft): they join its row in the pass, so they take rows of the
    budget and pages before any chunk does."""
    slots = scheduler.slots
    decoding = lambda: [r for r in slots if r is not None and r.is_prefill_done]
    decode_pages = lambda: sum(pages_for(r, 1) for r in decoding())
    make_room(scheduler, decode_pages)
    promised = decode_pages()  # pages the decode rows, then the chunks, will take
    room, chunks = budget - len(decoding()), []
    for request in decoding() if propose is not None else []:
        spare = free_pages(scheduler.pools) - promised + pages_for(request, 1)
        request.draft = propose(request, max(0, min(room, tokens_that_fit(request, spare) - 1)))
        room -= len(request.draft.tokens)
        promised += pages_for(request, 1 + len(request.draft.tokens)) - pages_for(request, 1)
    prefilling = [r for r in slots if r is not None and not r.is_prefill_done]
    while room > 0:
        if prefilling:
            request = prefilling.pop(0)
        elif None in slots and (request := scheduler.admit()) is not None:
            slots[slots.index(None)] = request
        else:
            break
        spare = free_pages(scheduler.pools) - promised  # an admission may take cached pages
        ids = request.prefill_tokens[request.offset : request.offset + room]
        ids = ids[: min(len(ids), tokens_that_fit(request, spare))]
        if ids:
            chunks.append((request, ids))
            room -= len(ids)
            promised += pages_for(request, len(ids))
    return decoding(), chunks


def tokens_that_fit(request, spare: float) -> float:
    """How many more tokens the request's cache can take with at most `spare` new pages."""
    if spare == math.inf:
        return math.inf
    cache = request.kv_cache[0]
    spare = int(spare) - cache.shares_last_page  # a fork copies its shared page first (4.8)
    return max(0, (len(cache.page_table) + spare) * cache.pool.page_size - cache.offset)


def hybrid_step(scheduler, budget: int, ladder: Ladder | None = None) -> None:
    """One iteration of the hybrid policy: one forward pass holding a row for every decoding
    request and prompt chunks up to `budget` rows in all. With a ladder (a compiled model) a
    pass holding a chunk is padded up to a ladder width of the budget, and a pass of decode
    rows alone up to the batch size, so a run compiles at most steps + 1 shapes."""
    raise NotImplementedError("Week 3 Day 4, Task 2: decode rows and prompt chunks in one pass")

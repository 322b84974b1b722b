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
    # BEGIN TASK Week 3 Day 4, Task 1: one forward pass over the rows of several requests
    t = tokens.shape[1]
    used = sum(seg.length for seg in segments)
    rope = model.layers[0].self_attn.rope
    starts = [seg.cache[0].offset for seg in segments]  # offsets before this pass
    positions = mx.concatenate(
        [rope.positions(s, 1, seg.length) for s, seg in zip(starts, segments)]
        + [mx.zeros((1, t - used), dtype=mx.int32)],
        axis=1,
    )  # [1, T]
    masks = [
        attention_mask(seg.length, s + seg.length, model.dtype) for s, seg in zip(starts, segments)
    ]
    h = model.embed_tokens[tokens]  # [1, T, E]
    for i, layer in enumerate(model.layers):
        q, k, v = layer.before_attention(h, positions)  # [1, H(_kv), T, D]
        caches = [seg.cache[i] for seg in segments]
        if all(cache.pages_in_place for cache in caches):
            outs = attend_in_place(q, k, v, segments, caches)  # written in Week 3 Day 5
        else:
            outs = [
                layer.self_attn.attend(q[:, :, rows_of(seg)], k[:, :, rows_of(seg)],
                                       v[:, :, rows_of(seg)], cache, mask)
                for seg, cache, mask in zip(segments, caches, masks)
            ]  # fmt: skip
        outs.append(mx.zeros((1, q.shape[1], t - used, q.shape[3]), dtype=q.dtype))
        h = layer.after_attention(h, mx.concatenate(outs, axis=2))  # [1, T, E]
    if rows is None:
        rows = [seg.start + seg.length - 1 for seg in segments]  # each segment's last row
    return linear(model.norm(h[:, mx.array(rows), :]), model.lm_head)  # [1, len(rows), V]
    # END TASK


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
    # BEGIN TASK Week 3 Day 5, Task 5: write the whole pass, then attend over the pages
    pool = caches[0].pool
    if any(cache.pool is not pool for cache in caches):
        raise ValueError("the segments of one layer must share that layer's pool")
    slots = mx.array([s for seg, cache in zip(segments, caches) for s in cache.reserve(seg.length)])
    rows = mx.concatenate([mx.arange(seg.start, seg.start + seg.length) for seg in segments])
    pages, within = slots // pool.page_size, slots % pool.page_size  # [used] each
    pool.key_pages[pages, :, within] = k[0].swapaxes(0, 1)[rows]  # [used, H_kv, D]
    pool.value_pages[pages, :, within] = v[0].swapaxes(0, 1)[rows]
    outs: list = [None] * len(segments)
    by_length: dict[int, list[int]] = {}
    for j, seg in enumerate(segments):
        by_length.setdefault(seg.length, []).append(j)
    for group in by_length.values():  # every decode row in one call
        query = mx.concatenate([q[:, :, rows_of(segments[j])] for j in group])  # [G, H, L, D]
        tables = [caches[j].page_table for j in group]
        out = paged_attention(query, pool, tables, [caches[j].offset for j in group],
                              block_size=pool.attention_block)  # fmt: skip
        for n, j in enumerate(group):
            outs[j] = out[n : n + 1]
    return outs
    # END TASK


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
    # BEGIN TASK Week 3 Day 4, Task 2: decode rows and prompt chunks in one pass
    decoding, chunks = plan_pass(scheduler, budget)
    segments, tokens = [], []
    for request, ids in [(r, r.generated[-1:]) for r in decoding] + chunks:
        segments.append(Segment(request.kv_cache, len(tokens), len(ids)))
        tokens += ids
    if ladder is not None:  # a pass with a chunk goes up the ladder, decode alone to batch size
        width = ladder(len(tokens), budget) if chunks else len(scheduler.slots)
        tokens += [tokens[-1]] * (width - len(tokens))
    logits = forward_ragged(scheduler.model, mx.array([tokens]), segments)[0]  # [segments, V]
    scheduler.passes += 1
    first = []  # the chunks that complete a fresh prompt: their last row gives its first token
    for j, (request, ids) in enumerate(chunks):
        request.materialize()
        if request.chunk_done(len(ids)):
            first.append(j)
    rows = list(range(len(decoding))) + [len(decoding) + j for j in first]
    takers = decoding + [chunks[j][0] for j in first]
    next_tokens = pick_tokens(logits[mx.array(rows)], takers) if rows else []
    for request, token in zip(decoding, next_tokens):
        request.decode_done(token)
    for j, token in zip(first, next_tokens[len(decoding) :]):
        chunks[j][0].accept(token)
    for request, ids in chunks:
        scheduler.report("prefill", request, len(ids))
    if decoding:
        scheduler.report("decode", None, len(decoding))
    for request in decoding + [r for r, _ in chunks]:
        if request.is_done:
            scheduler.slots[scheduler.slots.index(request)] = None
            scheduler.finish(request)
    # END TASK

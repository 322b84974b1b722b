"""Week 3 Day 6: memory planning for a bounded page pool.

A server's KV pool is always bounded, so running out of pages is the normal case under load.
The scheduler plans with pages instead of failing:

- admission: a waiting prompt starts only when the pool can hold it, plus a little headroom
  for the tokens it will generate next;
- preemption by recompute: when a pass needs pages that are not free, the most recently
  admitted running request gives all of its pages back and waits at the front of the queue;
  later its prompt and the tokens it had generated are prefilled again and decoding goes on;
- refusal: a request that could not fit even in an empty pool is refused up front, and the
  other requests run.

Every layer has its own pool of the same size, and every request holds the same number of
pages in each, so the first layer's pool stands for all of them.
"""

import math

HEADROOM_PAGES = 1  # admission leaves this many pages free beyond the prompt's own


def pages_for(request, tokens: int) -> int:
    """New pages (per layer) `request` needs to append `tokens` more tokens: 0 for a dense
    cache, which has no pool. A fork's shared last page (Week 4 Day 8) is copied first: one more."""
    cache = request.kv_cache[0]
    if not hasattr(cache, "page_table"):
        return 0
    pages = -(-(cache.offset + tokens) // cache.pool.page_size) - len(cache.page_table)
    return max(0, pages) + (tokens > 0 and cache.shares_last_page)


def free_pages(pools) -> float:
    """Pages the pools can still hand out (infinite without pools or without a limit): those
    of the fullest pool, since every layer takes its pages at once (a layer with a sliding
    window, Week 4 Day 7, gives pages back and may hold fewer)."""
    if not pools or pools[0].max_pages is None:
        return math.inf
    return pools[0].max_pages - max(pool.num_in_use for pool in pools)


def refusal(longest: int, pools) -> str | None:
    """Why a request that may hold up to `longest` tokens can never run with these pools, or
    None if it can: if its pages exceed the whole pool, not even preempting every other
    request would make room for it."""
    if not pools or pools[0].max_pages is None:
        return None  # an unbounded pool fits everyone
    raise NotImplementedError(
        "Week 3 Day 6, Task 3: refuse a request that cannot fit even an empty pool"
    )


def can_admit(tokens: int, reserved: int, pools) -> bool:
    """Whether a prompt of `tokens` tokens may start now: the free pages, less `reserved`
    pages still owed to a prompt already being prefilled, hold its pages plus the headroom."""
    if not pools or pools[0].max_pages is None:
        return True  # an unbounded pool never makes anyone wait
    raise NotImplementedError("Week 3 Day 6, Task 1: admit a prompt only when the pool can hold it")


def make_room(scheduler, need, protect=()) -> bool:
    """Preempt running requests, most recently admitted first, until the pages that
    `need()` counts are free; requests in `protect` are never preempted. True if it fits."""
    if free_pages(scheduler.pools) == math.inf:
        return True  # an unbounded pool always has room
    raise NotImplementedError(
        "Week 3 Day 6, Task 2: preempt the newest running requests until a pass fits"
    )

"""Week 4 Day 8: n answers to one prompt, prefilled once.

Best-of-n and self-consistency ask for several answers to the same prompt (`n` in OpenAI's
API). They differ from the first generated token on, so everything before it is the same: the
keys and values of the whole prompt. The first of the n requests prefills it; the others are
forks: each starts with a page table that holds the first request's pages, one more reference
on each (the counts of Week 4 Day 4), and prefills only the prompt's last token, whose logits
give its own first token (each fork samples with its own key).

The last of those pages is usually partly filled, and every request writes its next token into
it. So a write to a page that another table holds too first copies it to a page of the
writer's own (copy on write, TinyKvPagedCache.copy_on_write): the full pages stay shared for
as long as the requests live, and at most one partly filled page per fork is ever copied.
"""

from .prefix_cache import shares_prefix


def can_fork(request, parent) -> bool:
    """Whether `request` can start from `parent`'s pages now: both in sharing pools (Week 4
    Day 4), the same prompt, and the parent holding every prompt token but the last."""
    if parent is None or not shares_prefix(request) or not shares_prefix(parent):
        return False
    cached = parent.kv_cache[0].offset  # 0 once the parent gave its pages back
    return request.prompt_tokens == parent.prompt_tokens and cached >= len(parent.prompt_tokens) - 1


def fork_prefix(request, parent) -> int:
    """On admission: every layer's page table starts with the parent's pages that hold the
    prompt's tokens but the last, one more reference on each, the page tables' entries of its
    full pages copied (so its pages register in the prefix cache as the parent's did), and
    prefill goes on from the last prompt token. Returns the tokens shared."""
    # BEGIN TASK Week 4 Day 8, Task 6: start a fork's page tables with its parent's pages
    shared = len(request.prompt_tokens) - 1  # the last one is computed: its logits are needed
    for cache, parent_cache, entries, parent_entries in zip(
        request.kv_cache, parent.kv_cache, request.entries, parent.entries
    ):
        size = cache.pool.page_size
        pages = parent_cache.page_table[: -(-shared // size)]
        for page in pages:
            cache.pool.hold(page)
        cache.share(pages, shared)
        entries[:] = parent_entries[: shared // size]
    request.offset = shared
    return shared
    # END TASK

"""Week 4 Day 7: sequence parallelism, a long prompt prefilled by every rank of a group at once.

Tensor parallelism (Week 4 Day 2) splits the weights; here every rank holds the whole model and
the prompt is split instead: rank r takes the r-th of n contiguous parts and computes the
queries, keys and values of its own tokens only. Attention is the one place where a token needs
the others' keys. Ring attention gets them there without ever holding them all: each rank
starts from the attention of its queries over its own keys (causal), then passes its key/value
block to the next rank and receives the previous rank's, n - 1 times around the ring, merging
each visible block into its running result with the online softmax of Week 3 Day 5. A block
from an earlier part is wholly visible; one from a later part wholly in the future, so it is
passed on without being computed.

Afterwards each rank keeps only its own part's keys and values. A decode step runs the new
token on every rank; the last rank appends its key and value, each rank attends over what it
holds, and one all_gather of the small partial results (max, sum, output) per layer gives
every rank the exact attention over the whole sequence.
"""

import math

import mlx.core as mx

from .flash_attention import Partial, block_partial, finish, mask_future_keys, merge_partials
from .kv_cache import TinyKvCache, TinyKvFullCache


def split_sequence(length: int, n: int) -> list[tuple[int, int]]:
    """n contiguous parts (start, stop) of `length` positions, sizes differing by at most one
    (the first parts take the extra positions)."""
    if length < n:
        raise ValueError(f"a prompt of {length} tokens cannot be split over {n} ranks")
    size, extra = divmod(length, n)
    stops = [(r + 1) * size + min(r + 1, extra) for r in range(n)]
    return [(stop - size - (r < extra), stop) for r, stop in enumerate(stops)]


def grouped_queries(query: mx.array, num_kv_heads: int) -> mx.array:
    """query [B, H_q, L, D] scaled by 1 / sqrt(D) -> [B, H_kv, H_q / H_kv, L, D]."""
    b, h_q, l, d = query.shape
    return query.reshape(b, num_kv_heads, h_q // num_kv_heads, l, d) / math.sqrt(d)


def pass_along(
    keys: mx.array, values: mx.array, group: mx.distributed.Group, shape: tuple[int, ...]
) -> tuple[mx.array, mx.array]:
    """One step around the ring: send this rank's keys/values to the next rank and receive the
    previous rank's (of `shape`). Even ranks send first and odd ranks receive first, so no two
    neighbours both wait to send."""
    r, n = group.rank(), group.size()
    received = []
    for array in (keys, values):
        outgoing = mx.distributed.send(array, (r + 1) % n, group=group)
        incoming = mx.distributed.recv(shape, array.dtype, (r - 1) % n, group=group)
        for step in (outgoing, incoming) if r % 2 == 0 else (incoming, outgoing):
            mx.eval(step)  # one at a time, in this rank's order
        received.append(incoming)
    return received[0], received[1]


def blocked_partial(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    first_query: int,
    first_key: int,
    block_size: int = 512,
) -> Partial:
    """The partial result of queries q [B, H_kv, n_rep, L, D] (scaled) at positions
    first_query .. over keys/values [B, H_kv, S, D] at positions first_key .., walked
    block_size keys at a time (the [L, S] scores are never made), each key hidden from the
    queries it comes after."""
    partial = None
    query_pos = mx.arange(first_query, first_query + q.shape[-2])  # [L]
    for start in range(0, keys.shape[2], block_size):
        k = mx.expand_dims(keys[:, :, start : start + block_size], 2)  # [B, H_kv, 1, K, D]
        v = mx.expand_dims(values[:, :, start : start + block_size], 2)
        scores = q @ k.swapaxes(-2, -1)  # [B, H_kv, n_rep, L, K]
        key_pos = mx.arange(first_key + start, first_key + start + k.shape[3])
        if first_key + start + k.shape[3] - 1 > first_query:  # a key after some query
            scores = mask_future_keys(scores, query_pos[:, None], key_pos)
        block = block_partial(scores, v)
        partial = block if partial is None else merge_partials(partial, block)
    return partial


def ring_prefill_attention(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    group: mx.distributed.Group,
    parts: list[tuple[int, int]],
) -> mx.array:
    """Causal attention of this rank's part over the whole prompt. query [B, H_q, L, D], key and
    value [B, H_kv, L, D] are this rank's part (parts[rank]); -> [B, H_q, L, D]."""
    # BEGIN TASK Week 4 Day 7, Task 4: attend over the own part, then over the ring's blocks
    r, n = group.rank(), group.size()
    b, h_q, l, d = query.shape
    q = grouped_queries(query, key.shape[1])  # [B, H_kv, n_rep, L, D]
    first = parts[r][0]  # this part's first position
    partial = blocked_partial(q, key, value, first, first)  # causal in the own part
    keys, values = key, value
    for step in range(1, n):
        source = (r - step) % n  # whose block arrives in this step
        start, stop = parts[source]
        keys, values = pass_along(keys, values, group, (b, key.shape[1], stop - start, d))
        if source < r:  # an earlier part: every key is visible to every query here
            partial = merge_partials(partial, blocked_partial(q, keys, values, first, start))
    return finish(partial).reshape(b, h_q, l, d)
    # END TASK


def merge_ranks(partial: Partial, group: mx.distributed.Group) -> Partial:
    """Every rank's partial result merged: the exact attention over all their keys."""
    # BEGIN TASK Week 4 Day 7, Task 5: gather every rank's partial and merge them
    n = group.size()
    gathered = [mx.distributed.all_gather(x[None], group=group) for x in partial]  # [n, ...]
    merged = tuple(x[0] for x in gathered)
    for r in range(1, n):
        merged = merge_partials(merged, tuple(x[r] for x in gathered))
    return merged
    # END TASK


class RingKvCache(TinyKvCache):
    """One layer's keys/values on one rank of a sequence-parallel group: this rank's part of the
    prompt, and, on the last rank, every token decoded after it. Attention goes through attend
    (reads_in_place): ring attention during the prefill, merged partials when decoding."""

    reads_in_place = True

    def __init__(self, group: mx.distributed.Group, parts: list[tuple[int, int]]):
        self.group, self.parts = group, parts
        self.local = TinyKvFullCache()  # what this rank holds
        self.prefilled = False
        self._offset = parts[group.rank()][0]  # the position of the next token

    @property
    def offset(self) -> int:
        return self._offset

    @property
    def holds(self) -> int:
        """Tokens whose keys/values this rank holds."""
        return self.local.offset

    def attend(self, query: mx.array, key: mx.array, value: mx.array) -> mx.array:
        l = query.shape[2]
        self._offset += l
        if not self.prefilled:
            self.local.update_and_fetch(key, value)
            return ring_prefill_attention(query, key, value, self.group, self.parts)
        if l != 1:
            raise ValueError(f"after the ring prefill tokens come one at a time, got {l}")
        if self.group.rank() == self.group.size() - 1:  # the last part grows
            self.local.update_and_fetch(key, value)
        keys, values = self.local.keys[:, :, : self.holds], self.local.values[:, :, : self.holds]
        q = grouped_queries(query, key.shape[1])  # every key held precedes the query
        first = self.parts[self.group.rank()][0]  # the position of the first key held
        partial = blocked_partial(q, keys, values, self._offset - 1, first)
        b, h_q, _, d = query.shape
        return finish(merge_ranks(partial, self.group)).reshape(b, h_q, 1, d)

    def finish_prefill(self, length: int) -> None:
        """The whole prompt of `length` tokens is in: the next token is at `length`."""
        self.prefilled, self._offset = True, length

    def materialize(self) -> None:
        self.local.materialize()

    def rewind(self, length: int) -> None:
        raise ValueError("a sequence-parallel cache does not rewind")

    def release(self) -> None:
        self.local.release()


def ring_prefill(model, tokens: list[int], group: mx.distributed.Group):
    """Prefill `tokens` over the ranks of `group`, this rank taking its part. Returns the layer
    caches and the logits [1, V] of the last token, the same on every rank."""
    if model.group is not None or model.config.layer_windows:
        raise ValueError("ring prefill runs an unsharded model without sliding windows")
    parts = split_sequence(len(tokens), group.size())
    start, stop = parts[group.rank()]
    caches = [RingKvCache(group, parts) for _ in range(model.num_hidden_layers)]
    logits = model(mx.array([tokens[start:stop]]), start, caches, logits_to_keep=1)[:, -1, :]
    for cache in caches:
        cache.finish_prefill(len(tokens))
    mine = group.rank() == group.size() - 1  # the last part ends with the last token
    return caches, mx.distributed.all_sum(logits if mine else mx.zeros_like(logits), group=group)


def ring_generate(model, tokens: list[int], group: mx.distributed.Group, max_new_tokens: int):
    """Greedy tokens after a ring prefill of `tokens`, decoded over every rank's part."""
    caches, logits = ring_prefill(model, tokens, group)
    out = [mx.argmax(logits[0]).item()]
    while len(out) < max_new_tokens:
        logits = model(mx.array([[out[-1]]]), len(tokens) + len(out) - 1, caches)[:, -1, :]
        out.append(mx.argmax(logits[0]).item())
    return out

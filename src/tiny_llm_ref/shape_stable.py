"""Week 3 Day 3: shape-stable prefill.

A compiled function is traced once per input shape. Chunked prefill gives every prompt's last
chunk a new width (the remainder of the prompt length), so a compiled model would compile for
almost every request and keep every variant. Three pieces keep the set of shapes small:

- prefill_query_width rounds a chunk's row count up to one of a few widths (the ladder);
- CompileCache keeps at most `capacity` compiled variants, least recently used evicted;
- CompiledBlock compiles only the token-parallel halves of a transformer block and passes
  positions in as an array, so neither the offset nor the cache length is part of a shape.
"""

import os
from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx

PADDING_SWITCH = "TINY_LLM_PREFILL_QUERY_PADDING"  # "0" turns query padding off everywhere


def prefill_query_width(rows: int, chunk_width: int, steps: int = 3) -> int:
    """Round `rows` up to one of `steps` evenly spaced widths at or below chunk_width.

    The step is chunk_width / steps rounded up, so the top width is chunk_width itself:
    512 -> {171, 342, 512}.
    """
    # BEGIN TASK Week 3 Day 3, Task 1: round a chunk's rows up to the padding ladder
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 1 <= rows <= chunk_width:
        raise ValueError(f"rows must be in 1..chunk_width={chunk_width}, got {rows}")
    step = -(-chunk_width // steps)
    return min(-(-rows // step) * step, chunk_width)
    # END TASK


Ladder = Callable[[int, int], int]  # (rows, chunk_width) -> padded width


def query_ladder(model, query_padding: bool | Ladder | None) -> Ladder | None:
    """The ladder that pads prefill chunks, or None for no padding. The switch in the
    environment wins; then the caller's choice (True: three steps, or a ladder of its own);
    by default padding is on exactly when the model runs compiled."""
    if os.environ.get(PADDING_SWITCH) == "0":
        return None
    if query_padding is None:
        query_padding = bool(getattr(model, "compiled", False))
    if query_padding is True:
        return prefill_query_width
    return query_padding or None


def shape_key(args: tuple) -> tuple:
    """What a compiled variant is specialized on: each array's shape and dtype, and the value
    of every argument that is not an array."""
    return tuple((a.shape, a.dtype) if isinstance(a, mx.array) else a for a in args)


class CompileCache:
    """fn compiled with mx.compile, one variant per input-shape key, at most `capacity` kept.

    Counters: compiles (variants built), hits (calls served by a kept variant), evictions
    (variants dropped to stay within capacity) and traces (how often fn's Python body ran,
    which only happens while a variant is being traced).
    """

    def __init__(self, fn: Callable, capacity: int = 4):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.fn = fn
        self.capacity = capacity
        self.variants: OrderedDict[tuple, Callable] = OrderedDict()  # least recently used first
        self.compiles = self.hits = self.evictions = self.traces = 0

    def _traced(self, *args):
        self.traces += 1  # runs once per trace: a compiled call does not re-enter Python
        return self.fn(*args)

    def __call__(self, *args):
        # BEGIN TASK Week 3 Day 3, Task 5: one compiled variant per shape, least recently used evicted
        key = shape_key(args)
        if key in self.variants:
            self.hits += 1
            self.variants.move_to_end(key)
        else:
            self.compiles += 1
            self.variants[key] = mx.compile(self._traced)
            if len(self.variants) > self.capacity:
                self.variants.popitem(last=False)
                self.evictions += 1
        return self.variants[key](*args)
        # END TASK


def evaluate_arrays(obj) -> None:
    """Evaluate every array `obj` holds: in its attributes, lists, tuples and dicts, however
    deep. A compiled function keeps the arrays it reads from outside as constants of its
    trace; one that is still lazy (a RoPE table computed at construction, say) would be
    recomputed at every call of the compiled function."""
    arrays, seen = [], set()

    def walk(o) -> None:
        if isinstance(o, mx.array):
            arrays.append(o)
        elif id(o) not in seen:
            seen.add(id(o))
            children = o.values() if isinstance(o, dict) else o
            if isinstance(o, (list, tuple, dict)):
                for child in children:
                    walk(child)
            elif hasattr(o, "__dict__"):
                walk(vars(o))

    walk(obj)
    mx.eval(arrays)


class CompiledBlock:
    """A transformer block whose token-parallel halves (norms, projections, RoPE, the MLP) run
    compiled; attention over the cache runs between them as before."""

    def __init__(self, block, capacity: int = 4):
        evaluate_arrays(block)  # the weights and tables the compiled halves read
        self.block = block
        self.self_attn = block.self_attn
        self.before_attention = CompileCache(block.before_attention, capacity)
        self.after_attention = CompileCache(block.after_attention, capacity)

    @property
    def compile_caches(self) -> list[CompileCache]:
        return [self.before_attention, self.after_attention]

    def __call__(
        self, x: mx.array, offset: int | list[int], cache, mask: mx.array | str | None = None
    ) -> mx.array:
        """x [B, L, E] at positions offset.. -> [B, L, E], the block's output."""
        # BEGIN TASK Week 3 Day 3, Task 2: run a block with positions passed as an array
        b, l, _ = x.shape
        positions = self.self_attn.rope.positions(offset, b, l)  # [B, L]: an input, not a constant
        q, k, v = self.before_attention(x, positions)
        return self.after_attention(x, self.self_attn.attend(q, k, v, cache, mask))
        # END TASK

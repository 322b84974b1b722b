"""Week 3 Days 1-3 and 6: one request on its way through prefill and decode.

A Request holds its prompt, its per-layer caches and the tokens it has generated. It prefills
its prompt in chunks at its absolute offset (3.2), padded to a ladder width when the model runs
compiled (3.3), takes one decoded token at a time (3.1), and after a preemption (3.6) prefills
its prompt and generated tokens again. What runs it, and when, is the Scheduler's business
(scheduler.py).
"""

import mlx.core as mx

from tiny_llm_support import Tokenizer

from .memory_planning import free_pages, pages_for
from .paged_kv_cache import TinyKvPagedPool
from .prefix_cache import register_full_pages, shares_prefix
from .qwen3 import Qwen3Model
from .sampler import SamplingParams, pick_tokens
from .shape_stable import Ladder, query_ladder
from .speculative import Draft
from .structured_output import Grammar


class Request:
    """One prompt on its way through prefill and decode, with its own per-layer caches.

    `prompt` is text (encoded here) or a list of token ids. A request is done at an EOS token
    (unless ignore_eos), after max_new_tokens generated tokens, or when prompt plus generated
    tokens reach max_seq_len, whichever comes first. prefill_max_step is the chunk budget,
    the same setting as batch_generate's prefill_step. query_padding (Week 3 Day 3) pads each
    chunk to a width of prefill_query_width's ladder (True), of a ladder function given here,
    or not at all (False); None means padding exactly when the model runs compiled.
    `sampling` (Week 4 Day 3) picks its tokens: greedy unless it says otherwise; its grammar
    (Week 4 Day 8) is compiled here, before any page is taken.
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
        self.params = sampling or SamplingParams()
        self.sampler = self.params.sampler()  # None: greedy (Week 4 Day 3)
        self.key = (
            None if self.params.seed is None else mx.random.key((self.params.seed + 1) % 2**64)
        )
        self.draft = Draft([])  # the tokens a proposer guessed for this pass (Week 4 Day 5)
        self.grammar = None  # where its text is in its grammar, if it has one (Week 4 Day 8)
        if self.params.grammar is not None:
            self.grammar = Grammar(tokenizer, self.params.grammar, model.config.vocab_size)
        self.logprobs: list = []  # a TokenLogprob per generated token, if asked (Week 4 Day 8)
        self.fork_of: Request | None = None  # the request whose prompt pages it shares (4.8)
        if pools is None:
            self.kv_cache = model.create_kv_cache()
        else:
            self.kv_cache = model.create_paged_kv_cache(pools)
        self.entries: list[list[int]] = [[] for _ in self.kv_cache]  # per layer (Week 4 Day 4)
        self.cached_tokens = 0  # prompt tokens found in the prefix cache at first admission

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
        self.cache_grew()
        return self.is_prefill_done and not self.generated

    def cache_grew(self) -> None:
        """With a prefix cache (Week 4 Day 4), pages that just filled up become findable."""
        if shares_prefix(self):
            register_full_pages(self)

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
        self.offset += 1
        self.accept(token)
        self.cache_grew()

    def accept(self, token: int) -> None:
        """Record a generated token and decide whether the request is done."""
        if self.grammar is not None:  # Week 4 Day 8
            self.grammar.advance(token)
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

    def next_key(self) -> mx.array | None:
        """A fresh random key for one draw of speculative decoding's accept rule (Week 4
        Day 5): from the request's own seed, or None (MLX's global generator) without one."""
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    def text(self) -> str:
        return self.detokenizer.text

    def release(self) -> None:
        for layer_cache in self.kv_cache:
            layer_cache.release()
        for entries in self.entries:
            entries.clear()


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

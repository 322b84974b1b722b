"""Week 4 Day 5: speculative decoding. Several tokens per pass over the weights, each checked
by the model itself.

A decode step reads every weight to produce one token per request, and on a CPU or a GPU that
reading, not the arithmetic, sets its time: checking a few more rows in the same pass costs
little. So a cheap proposer guesses the next k tokens, and the request's decode row becomes
k + 1 rows of the ragged pass of 3.4: its last token and the guesses, at its own offset, under
the causal mask of a 3.2 chunk. Row i's logits say what the model would have generated after
the first i guesses; the guesses are kept while the model agrees, then one token of the model's
own follows. The cache keeps the rows of the kept tokens and rewinds the rest (3.3).

Two proposers: PromptLookup copies what followed the last occurrence of the request's last few
tokens in its own prompt and output (no model at all); DraftModel runs a smaller model with the
same vocabulary. With sampling, a guess is kept with probability min(1, p / q) and a rejected
one is replaced by a draw from the normalized max(0, p - q), so every token has exactly the
distribution plain sampling gives it.
"""

from dataclasses import dataclass

import mlx.core as mx

from .logprobs import record_logprobs
from .qwen3 import Qwen3Model
from .sampler import SamplingParams, keep_top_p, pick_tokens
from .stall_free import Segment, forward_ragged, plan_pass
from .structured_output import mask_rows


def sampling_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """logits [N, V] -> the probabilities [N, V] that the request's sampler draws from (its
    temperature, top_k and top_p, as make_sampler applies them)."""
    scaled = logits.astype(mx.float32) / params.temperature
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        kth = mx.sort(scaled, axis=-1)[:, -params.top_k][:, None]
        scaled = mx.where(scaled < kth, -mx.inf, scaled)
    if params.top_p < 1.0:
        scaled = keep_top_p(scaled, params.top_p)
    return mx.softmax(scaled, axis=-1)


@dataclass
class Draft:
    """What a proposer guessed for one request: the tokens, and with sampling the
    probabilities [len(tokens), V] it drew them from (None: each was certain, a point mass)."""

    tokens: list[int]
    probs: mx.array | None = None


class PromptLookup:
    """Guesses by copying: finds the most recent earlier place where the request's last `ngram`
    tokens (or fewer, down to one) occurred in its prompt and output, and proposes the tokens
    that followed there. Free to run, and right whenever the answer quotes its input."""

    def __init__(self, num_draft_tokens: int = 4, ngram: int = 3):
        if num_draft_tokens < 1 or ngram < 1:
            raise ValueError(
                f"num_draft_tokens and ngram must be >= 1, got {num_draft_tokens}, {ngram}"
            )
        self.num_draft_tokens, self.ngram = num_draft_tokens, ngram
        self.proposed = self.accepted = 0  # guesses made and kept, over the proposer's life

    def propose(self, request, most: int) -> Draft:
        return Draft(lookup(request.prompt_tokens + request.generated, self.ngram, most))

    def rewind(self, request) -> None:
        """Nothing is kept per request."""

    def forget(self, live: set[int]) -> None:
        """Nothing is kept per request."""


def lookup(context: list[int], ngram: int, most: int) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of the context's last n
    tokens, for the longest n <= ngram that occurred before; [] if none did."""
    # BEGIN TASK Week 4 Day 5, Task 1: propose by looking the last tokens up in the context
    for n in range(min(ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # latest first, not the tail itself
            if context[start : start + n] == tail:
                return context[start + n : start + n + most]
    return []
    # END TASK


class DraftModel:
    """Guesses with a smaller model of the same vocabulary. Each request has the draft's own
    dense cache, holding the same tokens as the request's cache; after a pass it is rewound to
    the tokens the target model kept."""

    def __init__(self, draft: Qwen3Model, target: Qwen3Model, num_draft_tokens: int = 4):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft.config.vocab_size} tokens and the "
                f"target's {target.config.vocab_size}: a draft must share the target's vocabulary"
            )
        self.model, self.num_draft_tokens = draft, num_draft_tokens
        self.caches: dict[int, list] = {}  # request id -> the draft's per-layer caches
        self.proposed = self.accepted = 0  # guesses made and kept, over the proposer's life

    def propose(self, request, most: int) -> Draft:
        if most == 0:
            return Draft([])
        # BEGIN TASK Week 4 Day 5, Task 1: propose with the draft model
        if request.prompt_idx not in self.caches:
            self.caches[request.prompt_idx] = self.model.create_kv_cache()
        caches = self.caches[request.prompt_idx]
        context = request.prompt_tokens + request.generated
        start = caches[0].offset  # what the draft's cache holds of the context already
        logits = self.model(mx.array([context[start:]]), start, caches, logits_to_keep=1)[0]
        tokens, probs = [], []
        for i in range(most):
            if request.params.greedy:
                token = mx.argmax(logits[-1]).item()
            else:
                p = sampling_probs(logits[-1:], request.params)  # [1, V]
                token = mx.random.categorical(mx.log(p), key=request.next_key()).item()
                probs.append(p)
            tokens.append(token)
            if i + 1 < most:
                logits = self.model(mx.array([[token]]), caches[0].offset, caches)[0]
        return Draft(tokens, mx.concatenate(probs) if probs else None)
        # END TASK

    def rewind(self, request) -> None:
        """Keep what the request's cache keeps: its first request.offset tokens."""
        caches = self.caches.get(request.prompt_idx)
        if caches is not None and caches[0].offset > request.offset:
            for cache in caches:
                cache.rewind(request.offset)

    def forget(self, live: set[int]) -> None:
        """Drop the caches of requests that are no longer decoding."""
        for rid in [rid for rid in self.caches if rid not in live]:
            for cache in self.caches.pop(rid):
                cache.release()


def accept_greedy(target: list[int], draft: list[int]) -> list[int]:
    """target: the model's argmax after each of the len(draft) + 1 rows. The tokens generated:
    the draft's tokens while they equal the model's, then the model's own next token."""
    # BEGIN TASK Week 4 Day 5, Task 2: keep the longest agreeing prefix, then the model's token
    kept = 0
    while kept < len(draft) and draft[kept] == target[kept]:
        kept += 1
    return draft[:kept] + [target[kept]]
    # END TASK


def accept_sampled(p: mx.array, draft: Draft, key_of) -> list[int]:
    """p [len(draft.tokens) + 1, V]: the target's sampling probabilities after each row. Keep
    guess i with probability min(1, p_i(x) / q_i(x)); the first one rejected is replaced by a
    draw from max(0, p_i - q_i), normalized, and the rest are dropped; if every guess is kept,
    one more token is drawn from the last row. key_of() gives a fresh random key per draw."""
    # BEGIN TASK Week 4 Day 5, Task 3: the accept rule that keeps the distribution exact
    out = []
    for i, token in enumerate(draft.tokens):
        if draft.probs is None:  # a point mass: q_i(token) = 1
            q = mx.zeros_like(p[i]).at[token].add(1.0)
        else:
            q = draft.probs[i]
        ratio = p[i, token].item() / max(q[token].item(), 1e-30)
        if mx.random.uniform(key=key_of()).item() < min(1.0, ratio):
            out.append(token)
            continue
        residual = mx.maximum(p[i] - q, 0.0)
        out.append(mx.random.categorical(mx.log(residual), key=key_of()).item())
        return out
    out.append(mx.random.categorical(mx.log(p[len(draft.tokens)]), key=key_of()).item())
    return out
    # END TASK


def speculative_step(scheduler, budget: int, proposer, policy: str = "hybrid") -> None:
    """One iteration in which every decoding request brings the proposer's guesses: its row
    becomes 1 + k rows, the budget and the pages count them, the model scores every row at once,
    and each request keeps what the accept rule keeps. Under the hybrid policy (3.4) the prompt
    chunks share that pass; under the alternate policy (3.1) they run in a pass of their own
    first, then the decode rows with their guesses."""

    def propose(request, most: int) -> Draft:
        draft = proposer.propose(request, min(most, proposer.num_draft_tokens, remaining(request)))
        return draft if request.grammar is None else grammatical(draft, request.grammar)

    decoding, chunks = plan_pass(scheduler, budget, propose)
    passes = [(decoding, chunks)] if policy == "hybrid" else [([], chunks), (decoding, [])]
    for rows, part in passes:
        if rows or part:
            check_pass(scheduler, rows, part, proposer)
    proposer.forget({r.prompt_idx for r in scheduler.running() if r.is_prefill_done})


def check_pass(scheduler, decoding: list, chunks: list, proposer) -> None:
    """One forward pass over the decoding requests' rows (the last token and the guesses of
    each) and the prompt chunks, then what each keeps."""
    segments, tokens, rows = [], [], []
    for request in decoding:
        ids = request.generated[-1:] + request.draft.tokens
        segments.append(Segment(request.kv_cache, len(tokens), len(ids)))
        rows += range(len(tokens), len(tokens) + len(ids))  # every row: each one is checked
        tokens += ids
    for request, ids in chunks:
        segments.append(Segment(request.kv_cache, len(tokens), len(ids)))
        tokens += ids
        rows.append(len(tokens) - 1)
    logits = forward_ragged(scheduler.model, mx.array([tokens]), segments, rows)[0]
    scheduler.passes += 1
    first, generated = keep_checked(decoding, logits, proposer)
    finish_chunks(scheduler, chunks, logits[first:])
    if decoding:
        scheduler.report("decode", None, generated)
    for request in decoding + [r for r, _ in chunks]:
        if request.is_done:
            scheduler.slots[scheduler.slots.index(request)] = None
            scheduler.finish(request)


def keep_checked(decoding: list, logits: mx.array, proposer) -> tuple[int, int]:
    """logits [rows, V]: the decoding requests' rows first, 1 + k of them per request, in
    order. Each request keeps what the accept rule keeps of its guesses, and every layer's
    cache (and the proposer's) is rewound past the rows of the rejected ones. Returns the rows
    read and the tokens generated."""
    # BEGIN TASK Week 4 Day 5, Task 4: check each request's guesses, keep what agrees, rewind
    first = generated = 0
    for request in decoding:
        n = 1 + len(request.draft.tokens)
        kept = verify(request, logits[first : first + n])  # 1 .. n tokens
        first += n
        proposer.proposed += n - 1
        for j, token in enumerate(kept):
            request.decode_done(token)
            generated += 1
            proposer.accepted += j < len(kept) - 1  # a guess, not the model's own token
            if request.is_done:
                break  # an EOS or a limit: the tokens after it are dropped
        for layer_cache in request.kv_cache:  # the rows of rejected guesses leave the cache
            if layer_cache.offset > request.offset:
                layer_cache.rewind(request.offset)
        proposer.rewind(request)
    return first, generated
    # END TASK


def verify(request, logits: mx.array) -> list[int]:
    """logits [1 + k, V] of the request's rows -> the tokens it generates in this pass. Under a
    grammar (Week 4 Day 8) row i is masked as the grammar stands after the first i guesses;
    a request that asked for logprobs records those of the tokens it keeps."""
    draft = request.draft
    if request.grammar is not None:
        logits = mask_rows(logits, list(request.grammar.guess_masks(draft.tokens)))
    if request.params.greedy:
        kept = accept_greedy(mx.argmax(logits, axis=-1).tolist(), draft.tokens)
    else:
        kept = accept_sampled(sampling_probs(logits, request.params), draft, request.next_key)
    record_logprobs(logits[: len(kept)], [request] * len(kept), kept)
    return kept


def grammatical(draft: Draft, grammar) -> Draft:
    """The guesses up to the first one the request's grammar forbids (Week 4 Day 8): the
    masked model could never keep that one or any after it, so they take no rows."""
    n = grammar.valid_guesses(draft.tokens)
    return Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n])


def finish_chunks(scheduler, chunks: list, logits: mx.array) -> None:
    """The prompt chunks of the pass, as in hybrid_step: a chunk that completes a fresh prompt
    takes its first token from its last row (logits [len(chunks), V])."""
    for j, (request, ids) in enumerate(chunks):
        request.materialize()
        if request.chunk_done(len(ids)):
            request.accept(pick_tokens(logits[j : j + 1], [request])[0])
        scheduler.report("prefill", request, len(ids))


def remaining(request) -> int:
    """Guesses worth making: the tokens the request may still hold (Request.longest, within the
    model's positions), less those it holds, less the one token of the model's own every pass
    adds."""
    longest = min(request.longest, request.model.max_seq_len)
    return max(0, longest - len(request.prompt_tokens) - len(request.generated) - 1)

"""Week 4 Day 3: an engine that never stops.

batch_generate is handed every prompt up front and returns when the last one is done. A server
cannot work that way: requests arrive while others run, each with its own sampling settings and
stop strings, and a client reads its text as it is produced and may hang up half way. The Engine
runs the scheduler of Week 3 one iteration at a time:

    rid = engine.add_request(prompt, params)   # at any time, also between two steps
    outputs = engine.step()                    # one iteration: what is new for each request
    engine.abort(rid)                          # from any state: slot and pages back at once

batch_generate (batch.py) is a loop over it (add every prompt, step until idle), so there is one
scheduler.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from tiny_llm_support import Tokenizer

from .logprobs import TokenLogprob, prompt_logprobs
from .memory_planning import free_pages, refusal
from .paged_kv_cache import TinyKvPagedPool
from .qwen3 import Qwen3Model
from .request import Request, prompt_tokens
from .sampler import SamplingParams
from .scheduler import BatchStep, Scheduler
from .shape_stable import Ladder, query_ladder
from .speculative import DraftModel, PromptLookup, speculative_step
from .stall_free import hybrid_step

POLICIES = ("alternate", "hybrid")
MAX_CHOICES = 16  # answers to one prompt (Week 4 Day 8): each takes a slot of its own


class RequestRefused(ValueError):
    """A request that could not fit even an empty page pool; nothing was allocated for it."""


@dataclass
class RequestOutput:
    """What one step produced for one request: the text and tokens new since its last output,
    and, on its last output, why it ended ("stop": EOS or a stop string, "length": max_tokens
    or max_seq_len, "abort"). cached_tokens: the prompt tokens its first admission found in the
    prefix cache (Week 4 Day 4) instead of prefilling them. logprobs (Week 4 Day 8): a
    TokenLogprob per token of token_ids when the request asked for them, else None."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Stream:
    """How much of one request's output the engine has handed out."""

    request: Request
    params: SamplingParams
    tokens_sent: int = 0
    chars_sent: int = 0


def stop_cut(text: str, stops: tuple[str, ...]) -> tuple[int, bool]:
    """`text` is generated but not sent yet. Returns how many of its characters may be sent now,
    and whether a stop string was found: then the text is cut where the first stop string
    starts. Otherwise an end of the text that could be the start of a stop string is held
    back until the next tokens decide it."""
    if not stops:
        return len(text), False
    raise NotImplementedError(
        "Week 4 Day 3, Task 3: cut at a stop string; hold back what may begin one"
    )


class Engine:
    """The Scheduler of Week 3 (either policy, dense or paged caches, memory planning and
    padding as in batch_generate), fed one request at a time and stepped one iteration at a
    time. Not thread-safe: one thread owns it (and MLX)."""

    def __init__(
        self,
        model: Qwen3Model,
        tokenizer: Tokenizer,
        max_seq_len: int = 512,
        batch_size: int = 5,
        prefill_step: int = 128,
        pools: list[TinyKvPagedPool] | None = None,
        policy: str = "alternate",
        query_padding: bool | Ladder | None = None,
        on_step: Callable[[BatchStep], None] | None = None,
        speculative: PromptLookup | DraftModel | None = None,
    ):
        check_limits(max_seq_len, batch_size, prefill_step)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
        self.speculative = speculative  # a proposer (Week 4 Day 5), or None
        self.model, self.tokenizer, self.pools = model, tokenizer, pools
        self.max_seq_len, self.prefill_step, self.policy = max_seq_len, prefill_step, policy
        self.query_padding, self.on_step = query_padding, on_step
        self.ladder = query_ladder(model, query_padding)  # the hybrid passes' widths (3.3)
        self.scheduler = Scheduler(model, batch_size, pools, self.observe)
        self.streams: dict[int, Stream] = {}
        self.ended: list[RequestOutput] = []  # final outputs decided between steps (aborts)
        self.next_id = 0
        self.counts = dict.fromkeys(COUNTS, 0)

    # --- requests in and out ---------------------------------------------------------------

    def check_prompt(self, prompt: str | list[int], request_id: int) -> list[int]:
        """The prompt's token ids; a ValueError if it is empty, holds an id outside the
        vocabulary or is longer than max_seq_len."""
        tokens = prompt_tokens(self.tokenizer, prompt, self.model.config.vocab_size, request_id)
        if len(tokens) > self.max_seq_len:
            raise ValueError(
                f"prompt {request_id} has {len(tokens)} tokens, more than "
                f"max_seq_len={self.max_seq_len}"
            )
        return tokens

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it joins the batch at a later step. Every check runs before
        anything is allocated; a request that could never fit the pool is reported to
        on_step ("refuse") and raises RequestRefused."""
        params = params or SamplingParams()
        params.check()
        rid = self.next_id
        tokens = self.check_prompt(prompt, rid)
        self.next_id += 1
        request = Request(
            self.model, self.tokenizer, tokens, self.prefill_step, rid, self.max_seq_len,
            self.pools, params.max_tokens, params.ignore_eos, self.query_padding, params,
        )  # fmt: skip
        reason = refusal(request.longest, self.pools)
        if reason is not None:
            self.scheduler.report("refuse", request, detail=f"prompt {rid} {reason}")
            raise RequestRefused(f"prompt {rid} {reason}")
        self.scheduler.pending.append(request)
        self.streams[rid] = Stream(request, params)
        return rid

    def add_choices(self, prompt: str | list[int], params: SamplingParams, n: int) -> list[int]:
        """n answers to one prompt (Week 4 Day 8), as n requests: the first prefills the
        prompt, the others are forks that start from its pages (fork.py), so the prompt is
        prefilled once. Answer i samples with seed + i (a seeded call is reproducible, and its
        answers differ). Without sharing pools each answer prefills the prompt itself."""
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be in 1 .. {MAX_CHOICES}, got {n}")
        # the first answer's add_request checks the prompt and params before anything is
        # queued, and every other answer differs from it only by a valid seed
        seed = lambda i: None if params.seed is None else (params.seed + i) % 2**64
        ids = [self.add_request(prompt, replace(params, seed=seed(i))) for i in range(n)]
        first = self.streams[ids[0]].request
        for rid in ids[1:]:
            self.streams[rid].request.fork_of = first
        return ids

    def abort(self, request_id: int) -> None:
        """Stop a request wherever it is; its slot and pages are free when this returns. The
        next step reports its last output. An unknown or finished id is ignored."""
        stream = self.streams.get(request_id)
        if stream is None:
            return
        self.scheduler.remove(stream.request)
        self.counts["requests_aborted"] += 1
        self.ended.append(self.end(stream, "", [], "abort"))

    def score(self, prompt: str | list[int], k: int = 0) -> list[TokenLogprob | None]:
        """Prompt logprobs (Week 4 Day 8): each prompt token's log-probability given the ones
        before it, with the k most likely tokens at its place; None for the first token. A
        forward pass of its own, outside the batch, on a cache dropped afterwards."""
        tokens = self.check_prompt(prompt, self.next_id)
        return prompt_logprobs(self.model, tokens, k, self.prefill_step)

    @property
    def has_work(self) -> bool:
        return self.scheduler.busy or bool(self.ended)

    # --- one iteration -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration, then each request's new text and tokens. An exception
        inside the iteration gives every page and slot back and ends every request."""
        outputs, self.ended = self.ended, []
        if self.scheduler.busy:
            before = self.progress()
            try:
                self.iterate()
                self.check_progress(before)
            except BaseException:
                self.release()
                raise
        for stream in list(self.streams.values()):
            output = self.collect(stream)
            if output is not None:
                outputs.append(output)
        return outputs

    def iterate(self) -> None:
        if self.speculative is not None:
            speculative_step(self.scheduler, self.prefill_step, self.speculative, self.policy)
        elif self.policy == "hybrid":
            hybrid_step(self.scheduler, self.prefill_step, self.ladder)
        else:
            self.scheduler.alternate_step()

    def progress(self) -> tuple:
        """What every iteration must change: the queue, the prompt being prefilled, or the
        tokens cached or generated by a running request."""
        s = self.scheduler
        running = tuple((r, r.offset, len(r.generated)) for r in s.running())
        return len(s.pending), s.prefilling, s.prefilling and s.prefilling.offset, running

    def check_progress(self, before: tuple) -> None:
        for slot, request in enumerate(self.scheduler.slots):
            if request is not None and request.is_done:
                raise RuntimeError(
                    f"request {request.prompt_idx} is done but still holds slot {slot}: a "
                    "finished request must leave its slot in the iteration it ends"
                )
        if self.progress() == before:
            s = self.scheduler
            pages = ""
            if self.pools and self.pools[0].max_pages is not None:
                pages = f", {int(free_pages(self.pools))} of {self.pools[0].max_pages} pages free"
            raise RuntimeError(
                f"the {self.policy} scheduler made no progress in an iteration: no prompt "
                "token was prefilled, no token generated, no request admitted, preempted or "
                f"finished ({len(s.pending)} waiting, {len(s.running())} in slots, "
                f"{'one' if s.prefilling else 'none'} prefilling outside the slots{pages}). "
                "Likely causes: pages that never come back to the pool (a preempted request "
                "must release its caches in Request.preempt, a finished one in finish), so the "
                "next prompt waits for them forever; a prompt that is admitted but never given "
                "a chunk; an iteration that skips the decode rows"
            )

    def collect(self, stream: Stream) -> RequestOutput | None:
        """The request's new tokens and the text that may be sent; its last output when it
        has ended (the scheduler finished it, or a stop string appeared in its text)."""
        request = stream.request
        tokens = request.generated[stream.tokens_sent :]
        text = self.visible_text(request)[stream.chars_sent :]
        cut, stopped = stop_cut(text, stream.params.stop)
        if stopped:
            if self.scheduler.remove(request):  # still running: it ends here
                self.scheduler.report("finish", request)
            reason = "stop"
        elif request.is_done:
            cut, reason = len(text), self.finish_reason(request)
        elif not tokens and not cut:
            return None
        else:
            reason = None
        stream.tokens_sent += len(tokens)
        stream.chars_sent += cut
        if reason is None:
            return self.output(stream, text[:cut], tokens, None)
        self.counts["requests_finished"] += 1
        return self.end(stream, text[:cut], tokens, reason)

    def end(self, stream: Stream, text: str, tokens: list[int], reason: str) -> RequestOutput:
        del self.streams[stream.request.prompt_idx]
        return self.output(stream, text, tokens, reason)

    @staticmethod
    def output(stream: Stream, text: str, tokens: list[int], reason: str | None) -> RequestOutput:
        """An output of `tokens`, the stream's last ones (tokens_sent already counts them)."""
        request, logprobs = stream.request, None
        if stream.params.logprobs is not None:
            first = stream.tokens_sent - len(tokens)
            logprobs = request.logprobs[first : stream.tokens_sent]
        return RequestOutput(
            request.prompt_idx, text, tokens, reason, len(request.prompt_tokens),
            len(request.generated), request.cached_tokens, logprobs,
        )  # fmt: skip

    def visible_text(self, request: Request) -> str:
        """The request's text without the EOS token's own text at its end."""
        text = request.text()
        if request.generated and request.generated[-1] in request.eos_token_ids:
            eos_text = self.tokenizer.decode(request.generated[-1:])
            text = text.removesuffix(eos_text)
        return text

    @staticmethod
    def finish_reason(request: Request) -> str:
        return "stop" if request.generated[-1] in request.eos_token_ids else "length"

    # --- bookkeeping ---------------------------------------------------------------------------

    def observe(self, step: BatchStep) -> None:
        """Count what the scheduler reports, then pass the event on."""
        if step.kind == "prefill":
            self.counts["prompt_tokens_prefilled"] += step.tokens
        elif step.kind == "admit":
            self.counts["prompt_tokens_cached"] += step.tokens
        elif step.kind == "decode":
            self.counts["tokens_decoded"] += step.tokens
        elif step.kind == "preempt":
            self.counts["preemptions"] += 1
        if self.on_step is not None:
            self.on_step(step)

    def stats(self) -> dict[str, int | None]:
        """Gauges and counters for a metrics page."""
        s = self.scheduler
        free = free_pages(self.pools)
        return {
            "running": len(s.running()) + (s.prefilling is not None),
            "waiting": len(s.pending),
            "pages_in_use": self.pools[0].num_in_use if self.pools else 0,
            "pages_cached": getattr(self.pools[0], "num_cached", 0) if self.pools else 0,
            "pages_free": None if free == math.inf else int(free),
            "tokens_proposed": getattr(self.speculative, "proposed", 0),
            "tokens_accepted": getattr(self.speculative, "accepted", 0),
            **self.counts,
        }

    def release(self) -> None:
        """Give every cache back and forget every request (after an error, or at shutdown)."""
        self.scheduler.release()
        for stream in self.streams.values():
            stream.request.release()
        self.streams.clear()
        if self.speculative is not None:
            self.speculative.forget(set())


COUNTS = (
    "prompt_tokens_prefilled",
    "prompt_tokens_cached",
    "tokens_decoded",
    "preemptions",
    "requests_finished",
    "requests_aborted",
)


def check_limits(max_seq_len: int, batch_size: int, prefill_step: int) -> None:
    for name, value in [
        ("max_seq_len", max_seq_len),
        ("batch_size", batch_size),
        ("prefill_step", prefill_step),
    ]:
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

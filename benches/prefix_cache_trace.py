"""bench-prefix-cache's agent trace (AgentTrace), its closed-loop replay and the run's numbers:
each turn sends the whole conversation so far and arrives the moment the previous answer is
complete, served by the solution's Engine or by mlx-lm as mlx_lm.server serves it."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from benches import harness, trace_run

MLX_LM_MODEL_KEY = ("bench-prefix-cache", None, None)  # mlx_lm.server keys a cache by model


@dataclass
class AgentTrace(trace_run.TraceContent):
    """A shared system prompt and, per conversation, each turn's new user message (ids)."""

    system: list[int]
    conversations: list[list[list[int]]]  # [conversation][turn] -> the user message
    max_tokens: int  # every answer's length

    @property
    def max_seq_len(self) -> int:
        """The longest request: a conversation's last turn with its answer."""
        n = len(self.system)
        return max(n + sum(map(len, c)) + self.max_tokens * len(c) for c in self.conversations)

    def describe(self) -> dict[str, Any]:
        lengths = [[len(u) for u in c] for c in self.conversations]
        return {"sha256": self.sha256(), "system_tokens": len(self.system),
                "conversations": len(lengths), "turns": max(len(c) for c in lengths),
                "max_tokens": self.max_tokens, "user_message_tokens": lengths,
                "max_seq_len": self.max_seq_len}  # fmt: skip


class Requests:
    """A run's requests in arrival order, and its clock (from the start: every first turn's)."""

    def __init__(self, trace: AgentTrace):
        self.trace, self.t0 = trace, time.perf_counter()
        self.history = [list(trace.system) for _ in trace.conversations]  # sent and answered
        self.records: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def next_prompt(self, conversation: int, turn: int) -> tuple[dict[str, Any], list[int]]:
        """The record and prompt of a conversation's turn (from 0), arriving now."""
        prompt = self.history[conversation] + self.trace.conversations[conversation][turn]
        self.history[conversation] = prompt
        self.records.append({"conversation": conversation, "turn": turn + 1,
                             "prompt_tokens": len(prompt), "cached_tokens": None,
                             "prefill_tokens": None, "arrival_s": self.now(),
                             "start_s": None,  # admitted (engine) or taken up (mlx-lm)
                             "first_token_s": None, "finish_s": None, "token_ids": [],
                             "text": ""})  # fmt: skip
        return self.records[-1], prompt

    def answered(self, record: dict[str, Any]) -> tuple[int, int] | None:
        """Record the end of a request; the (conversation, turn from 0) that comes next."""
        record["finish_s"] = self.now()
        c, turn, generated = record["conversation"], record["turn"], len(record["token_ids"])
        if generated != self.trace.max_tokens:
            raise trace_run.WrongOutput(
                f"conversation {c} turn {turn}: {generated} tokens generated, max_tokens is "
                f"{self.trace.max_tokens} (EOS ignored)"
            )
        self.history[c] = self.history[c] + record["token_ids"]  # a new list: the prompt stays
        return (c, turn) if turn < len(self.trace.conversations[c]) else None


def serve_engine(api, model, tokenizer, trace: AgentTrace, spec: dict[str, Any]):
    """The trace through the solution's Engine on fresh paged pools (prefix_cache=True in mode
    "on"): (records, what the pools and the engine counted)."""
    shared = {"prefix_cache": True} if spec["mode"] == "on" else {}  # no such keyword before 4.4
    pools = model.create_kv_pools(spec["page_size"], None, **shared)
    by_id: dict[int, dict[str, Any]] = {}

    def on_step(step) -> None:
        if step.kind == "admit" and step.request is not None:
            record = by_id.get(step.request.prompt_idx)
            if record is not None and record["start_s"] is None:
                record["start_s"] = requests.now()

    engine = api.Engine(model, tokenizer, max_seq_len=trace.max_seq_len, pools=pools,
                        batch_size=spec["batch_size"], prefill_step=spec["prefill_step"],
                        policy="hybrid", on_step=on_step)  # fmt: skip
    params = api.SamplingParams(max_tokens=trace.max_tokens, ignore_eos=True)
    requests = Requests(trace)  # the run's clock starts here, the engine made

    def add(conversation: int, turn: int) -> None:
        record, prompt = requests.next_prompt(conversation, turn)
        by_id[engine.add_request(prompt, params)] = record

    for c in range(len(trace.conversations)):
        add(c, 0)
    while engine.has_work:
        outputs = engine.step()
        now = requests.now()  # the step's tokens arrive together
        for out in outputs:
            record = by_id[out.request_id]
            if out.token_ids and record["first_token_s"] is None:
                record["first_token_s"] = now
            record["token_ids"] += out.token_ids
            record["text"] += out.text
            if out.finish_reason is not None:
                record["cached_tokens"] = out.cached_tokens
                record["prefill_tokens"] = out.prompt_tokens - out.cached_tokens
                if (following := requests.answered(record)) is not None:
                    add(*following)
    stats, pool = engine.stats(), pools[0]
    return requests.records, {
        "prefill_tokens": stats["prompt_tokens_prefilled"],
        "cached_tokens": stats.get("prompt_tokens_cached"),
        "decoded_tokens": stats["tokens_decoded"],
        "preemptions": stats["preemptions"],
        "peak_pages": pool.peak_in_use,  # held by page tables at once (cached pages not counted)
        "pages_created": pool.num_pages,
        "pages_cached_end": stats.get("pages_cached"),
        "pages_in_use_end": stats["pages_in_use"],
        "evictions": getattr(pool, "evictions", None),
    }


def serve_mlx_lm(model, trace: AgentTrace):
    """The trace through mlx-lm one request at a time, as mlx_lm.server serves: the nearest cached
    prefix (LRUPromptCache), stream_generate over the rest, the cache put back under prompt +
    answer. (records, what the cache held)"""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    tokenizer = trace_run.mlx_lm_tokenizer()  # EOS ignored
    store = LRUPromptCache()  # mlx_lm.server's default size (--prompt-cache-size 10)
    requests = Requests(trace)
    queue = deque(requests.next_prompt(c, 0) for c in range(len(trace.conversations)))
    while queue:
        record, prompt = queue.popleft()
        record["start_s"] = requests.now()
        cache, rest = store.fetch_nearest_cache(MLX_LM_MODEL_KEY, prompt)
        if not rest:
            raise RuntimeError("a prompt of the trace was cached whole: nothing to prefill")
        record["cached_tokens"], record["prefill_tokens"] = len(prompt) - len(rest), len(rest)
        cache = make_prompt_cache(model) if cache is None else cache
        for response in stream_generate(
            model, tokenizer, rest, max_tokens=trace.max_tokens, prompt_cache=cache
        ):
            if record["first_token_s"] is None:
                record["first_token_s"] = requests.now()
            record["token_ids"].append(response.token)
            if response.finish_reason is not None:
                break
        following = requests.answered(record)
        store.insert_cache(MLX_LM_MODEL_KEY, prompt + record["token_ids"], cache)
        if following is not None:
            queue.append(requests.next_prompt(*following))
    records = requests.records
    return records, {"prefill_tokens": sum(r["prefill_tokens"] for r in records),
                     "cached_tokens": sum(r["cached_tokens"] for r in records),
                     "prompt_cache_entries_end": len(store),
                     "prompt_cache_bytes_end": store.nbytes}  # fmt: skip


def run_metrics(records: list[dict[str, Any]], counts: dict[str, Any]) -> dict[str, Any]:
    """The run's numbers (ms unless named _s; "later": turns 2 and after), and per-turn lists."""
    ms = lambda seconds, q: None if not seconds else 1000 * harness.percentile(seconds, q)
    ttft = lambda rs, q: ms([r["first_token_s"] - r["arrival_s"] for r in rs], q)
    last = max(r["turn"] for r in records)
    turns = [[r for r in records if r["turn"] == t] for t in range(1, last + 1)]
    first, later = turns[0], [r for rs in turns[1:] for r in rs]
    wall, prompt = max(r["finish_s"] for r in records), sum(r["prompt_tokens"] for r in records)
    generated = sum(len(r["token_ids"]) for r in records)
    return {
        "requests": len(records), "wall_s": wall, "generated_tokens": generated,
        "generated_tokens_per_s": generated / wall, "prompt_tokens": prompt,
        "prefill_tokens": counts["prefill_tokens"], "cached_tokens": counts["cached_tokens"],
        "prefill_fraction": counts["prefill_tokens"] / prompt,
        "ttft_turn1_ms_p50": ttft(first, 50), "ttft_turn1_ms_p95": ttft(first, 95),
        "ttft_later_ms_p50": ttft(later, 50), "ttft_later_ms_p95": ttft(later, 95),
        "wait_later_ms_p50": ms([r["start_s"] - r["arrival_s"] for r in later], 50),
        "peak_pages": counts.get("peak_pages"),
        "by_turn": {
            "ttft_ms_p50": [ttft(rs, 50) for rs in turns],
            "ttft_ms_p95": [ttft(rs, 95) for rs in turns],
            "prompt_tokens": [sum(r["prompt_tokens"] for r in rs) for rs in turns],
            "prefill_tokens": [sum(r["prefill_tokens"] for r in rs) for rs in turns],
        },
    }  # fmt: skip

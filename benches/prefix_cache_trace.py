"""bench-prefix-cache's agent trace (benches/traces/prefix-agent.json) and its replay. The file:
a system prompt shared by several conversations, each turn's new user message as token ids
(AgentTrace; new_trace_text makes one, read_trace reads and checks it). The replay, closed-loop:
each turn sends the whole conversation so far and arrives the moment the previous answer is
complete (Requests), served by the solution's Engine (serve_engine) or by mlx-lm as
mlx_lm.server serves it (serve_mlx_lm).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benches import harness, trace_run

TRACE_SCHEMA = "tiny-llm/prefix-trace/v1"
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "prefix-agent.json"
# The SHA-256 of the committed trace file's bytes: a changed file is refused, so that results
# under one name always come from one trace. Regenerate it with --write-trace (the file records
# the command) and update this line together with it.
DEFAULT_TRACE_SHA256 = "98be1060f03384c4282cb17c4fd3990c74aaf66327885ddc2bb2244908009bf6"
MLX_LM_MODEL_KEY = ("bench-prefix-cache", None, None)  # mlx_lm.server keys a cache by model


# --- the trace file -----------------------------------------------------------------------


@dataclass
class AgentTrace(trace_run.TraceContent):
    """A shared system prompt and, per conversation, each turn's new user message (ids)."""

    system: list[int]
    conversations: list[list[list[int]]]  # [conversation][turn] -> the user message
    max_tokens: int  # every answer's length

    @property
    def max_seq_len(self) -> int:
        """The longest request: a conversation's last turn with its answer."""
        return max(
            len(self.system) + sum(len(u) for u in turns) + self.max_tokens * len(turns)
            for turns in self.conversations
        )

    def describe(self) -> dict[str, Any]:
        lengths = [[len(u) for u in c] for c in self.conversations]
        return {"sha256": self.sha256(), "system_tokens": len(self.system),
                "conversations": len(lengths), "turns": max(len(c) for c in lengths),
                "max_tokens": self.max_tokens, "user_message_tokens": lengths,
                "max_seq_len": self.max_seq_len}  # fmt: skip


def new_trace_text(args: argparse.Namespace, model: harness.BenchModel) -> str:
    """A new trace file: ids drawn uniformly from the model's ordinary ids, the system prompt
    from --seed, the user messages (lengths uniform in --user-tokens) from --seed + 1; JSON
    with one line per id list, so that a diff of the file stays readable."""
    (low, high), n, turns = args.user_tokens, args.conversations, args.turns
    vocab = (model.token_ids, model.excluded_ids)
    system = trace_run.make_trace(args.seed, 1, (args.system_tokens,) * 2, (1, 1), *vocab)
    messages = trace_run.make_trace(args.seed + 1, n * turns, (low, high), (1, 1), *vocab).prompts
    sizes = f"--system-tokens {args.system_tokens} --conversations {n} --turns {turns}"
    command = (f"python benches/prefix_cache.py --write-trace PATH --model {model.name} --seed "
               f"{args.seed} {sizes} --user-tokens {low} {high} --max-tokens "
               f"{args.max_tokens}")  # fmt: skip
    generator = {"seed": args.seed, "token_ids": list(model.token_ids),
                 "excluded_ids": model.excluded_ids, "system_tokens": args.system_tokens,
                 "conversations": n, "turns": turns, "user_tokens": [low, high],
                 "model": model.name, "command": command}  # fmt: skip
    about = (
        "an agent-like trace for bench-prefix-cache: a system prompt shared by every "
        "conversation; per conversation, the new user message of each turn (token ids). Each "
        "turn's prompt is the system prompt, then every earlier user message followed by the "
        "server's own answer to it, then the turn's user message."
    )
    head = {"schema": TRACE_SCHEMA, "about": about, "generator": generator,
            "max_tokens": args.max_tokens}  # fmt: skip
    ids = lambda xs: json.dumps(xs, separators=(",", ":"))
    conversations = [messages[c * turns : (c + 1) * turns] for c in range(n)]
    rows = [",\n".join(f"      {ids(u)}" for u in c) for c in conversations]
    rows = ",\n".join(f"    [\n{c}\n    ]" for c in rows)
    body = {"system": ids(system.prompts[0]), "conversations": f"[\n{rows}\n  ]"}
    return trace_run.trace_text(head, body)


def read_trace(path: Path) -> tuple[AgentTrace, dict[str, Any], str]:
    """The trace in a file, the file's other fields, and the SHA-256 of its bytes."""
    data, sha = trace_run.read_trace_file(path, TRACE_SCHEMA, trace_problem)
    other = {k: v for k, v in data.items() if k not in ("system", "conversations", "about")}
    return AgentTrace(data["system"], data["conversations"], data["max_tokens"]), other, sha


def trace_problem(data: dict[str, Any]) -> str | None:
    """What a trace file's contents lack, or None."""
    nonempty = lambda xs, ok: isinstance(xs, list) and xs and all(ok(x) for x in xs)
    turns = lambda c: nonempty(c, trace_run.is_token_ids)
    if trace_run.is_token_ids(data.get("system")) and nonempty(data.get("conversations"), turns):
        return None
    return (
        "'system' must be a non-empty list of token ids, 'conversations' a non-empty list of "
        "conversations, each a non-empty list of user messages (ids)"
    )


# --- the replay, closed-loop ---------------------------------------------------------------


class Requests:
    """Every request of a run, in the order they arrived, and the run's clock (seconds from its
    start, when every first turn arrives)."""

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
    """The trace, closed-loop, through the solution's Engine on fresh paged pools (with
    prefix_cache=True in mode "on"): (records, what the pools and the engine counted)."""
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
    requests = Requests(trace)

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
    """The trace, closed-loop, through mlx-lm one request at a time in arrival order, as
    mlx_lm.server's unbatched path serves it: the nearest cached prefix from its LRUPromptCache
    (a deep copy, trimmed when it came from a longer prompt), stream_generate over the rest of
    the prompt with that cache, then the cache inserted back under prompt + answer. Returns
    (records, what the prompt cache held at the end)."""
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
        if cache is None:
            cache = make_prompt_cache(model)
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

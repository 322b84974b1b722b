"""Week 4 Day 4: what a prefix cache saves on an agent-like trace.

The trace (a committed JSON file, checked by its SHA-256) is a system prompt shared by several
conversations of several turns each. Every turn sends the whole conversation so far again: the
system prompt, the earlier user messages and the server's own earlier answers, then a new user
message. Prompts and messages are token ids (random weights: the text would mean nothing);
every answer is `max_tokens` tokens, EOS ignored, greedy.

The conversations run closed-loop: every first turn arrives at t = 0, and a conversation's next
turn arrives the moment its previous answer is complete. Three ways to serve it, each run in a
fresh process (one warm-up of a few requests first, on caches thrown away afterwards), the
order reversed on every other repeat:

- off     the reference Engine on plain paged pools (every prompt prefilled in full);
- on      the same Engine, same pages, policy and budget, with prefix_cache=True: full pages
          shared by content, so a turn prefills only what its conversation added since the
          last page boundary it reached;
- mlx-lm  mlx-lm on the same weights, one request at a time, as mlx_lm.server serves a model
          it does not batch: fetch_nearest_cache from an LRUPromptCache, stream_generate
          over the rest of the prompt with that cache, insert_cache with prompt + answer.

Reported per mode: prompt tokens computed (prefilled) and found cached, time to first token
(p50/p95 over the first turns and over the later turns; a turn's clock starts when it
arrives), wall time and generated tokens/s, pages held at the peak (engine modes), and whether
its generated token ids equal those of the cache-off run. The issue's targets are checked and
reported, met or not.

    pdm run bench-prefix-cache                                  # the full run (8-layer 0.6B shape)
    pdm run bench-prefix-cache --conversations 2 --turns 2 --system-tokens 128   # a quick look
    pdm run bench-prefix-cache --write-trace PATH [--seed N ...]  # make a trace, run nothing

Writes JSON (host, MLX, BLAS, model, the trace's SHA-256 and the part of it used, every
request of every run, per-mode medians, the targets) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiny_llm_support import startup

if __name__ == "__main__":
    startup.start()  # Ctrl-C or an MLX that cannot load: one line, from here on

# ruff: noqa: E402 (the imports below load MLX)
import common
import mlx.core as mx
from trace_run import (
    IdsOnlyTokenizer,
    NoTextTokenizer,
    TraceContent,
    TraceError,
    WrongOutput,
    check_max_tokens,
    is_committed_trace,
    make_trace,
    read_trace_file,
    write_trace_file,
)

from tiny_llm_support import choose_device, mlx_lm_qwen3
from tiny_llm_support.cli import int_at_least, load_solution

SCHEMA = "tiny-llm/bench-prefix-cache/v1"
TRACE_SCHEMA = "tiny-llm/prefix-trace/v1"
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "prefix-agent.json"
# The SHA-256 of the committed trace file's bytes: a changed file is refused, so that results
# under one name always come from one trace. Regenerate it with --write-trace (the file records
# the command) and update this line together with it.
DEFAULT_TRACE_SHA256 = "98be1060f03384c4282cb17c4fd3990c74aaf66327885ddc2bb2244908009bf6"
MODES = ("off", "on", "mlx-lm")
DEFAULT_LAYERS = 8  # for a shortcut with an embedded config: "the 8-layer Qwen3-0.6B shape"
MLX_LM_MODEL_KEY = ("bench-prefix-cache", None, None)  # mlx_lm.server keys a cache by model
WARMUP_PROMPT_TOKENS = 256
WARMUP_SEED = 1_000_003

DEFINITIONS = {
    "arrival_s": "when a request arrives: 0 for every first turn, the moment the previous "
    "turn's answer is complete for a later one (seconds from the run's start)",
    "start_s": "when the engine admitted the request, or mlx-lm took it up",
    "ttft": "first_token_s - arrival_s: waiting included",
    "prefill_tokens": "prompt tokens the model computed (the engine's prompt_tokens_prefilled; "
    "for mlx-lm the rest of the prompt after its cached prefix)",
    "cached_tokens": "prompt tokens whose keys and values came from the cache",
    "peak_pages": "the most pages per layer held by page tables at once (cached pages no "
    "table holds are not counted)",
    "turns 2..": "later: every turn after the first",
}

# The issue's targets: cache on against cache off.
TARGET_PREFILL_FRACTION = 0.20  # prompt tokens computed, on / off, at most
TARGET_TTFT_SPEEDUP = 5.0  # p50 TTFT of turns 2.., off / on, at least

DESCRIPTION = (  # what --help says first
    "Prefix caching on an agent-like trace: the engine with and without it, and mlx-lm's "
    "prompt cache. Each (mode, repeat) runs in a fresh process."
)


# --- the trace -----------------------------------------------------------------------------


@dataclass
class AgentTrace(TraceContent):
    """A shared system prompt and, per conversation, each turn's new user message (ids)."""

    system: list[int]
    conversations: list[list[list[int]]]  # [conversation][turn] -> the user message
    max_tokens: int  # every answer's length

    @property
    def turns(self) -> int:
        return max(len(c) for c in self.conversations)

    @property
    def max_seq_len(self) -> int:
        """The longest request: a conversation's last turn with its answer."""
        return max(
            len(self.system) + sum(len(u) for u in turns) + self.max_tokens * len(turns)
            for turns in self.conversations
        )

    def cut(self, conversations: int | None, turns: int | None, system: int | None) -> AgentTrace:
        """The first `conversations`, each cut to its first `turns`, the system prompt to its
        first `system` tokens (None: all of it)."""
        return AgentTrace(
            self.system[:system],
            [c[:turns] for c in self.conversations[:conversations]],
            self.max_tokens,
        )

    def describe(self) -> dict[str, Any]:
        lengths = [[len(u) for u in c] for c in self.conversations]
        return {
            "sha256": self.sha256(),
            "system_tokens": len(self.system),
            "conversations": len(self.conversations),
            "turns": self.turns,
            "max_tokens": self.max_tokens,
            "user_message_tokens": lengths,
            "max_seq_len": self.max_seq_len,
        }


def make_agent_trace(args: argparse.Namespace, model: common.BenchModel) -> dict[str, Any]:
    """A new trace file's contents: ids drawn uniformly from the model's ordinary ids, the
    system prompt from --seed, the user messages (lengths uniform in --user-tokens) from
    --seed + 1."""
    low, high = args.user_tokens
    system = make_trace(
        args.seed, 1, (args.system_tokens,) * 2, (1, 1), model.token_ids, model.excluded_ids
    ).prompts[0]
    messages = make_trace(
        args.seed + 1,
        args.conversations * args.turns,
        (low, high),
        (1, 1),
        model.token_ids,
        model.excluded_ids,
    ).prompts
    conversations = [
        messages[c * args.turns : (c + 1) * args.turns] for c in range(args.conversations)
    ]
    return {
        "schema": TRACE_SCHEMA,
        "about": "an agent-like trace for bench-prefix-cache: a system prompt shared by every "
        "conversation; per conversation, the new user message of each turn (token ids). Each "
        "turn's prompt is the system prompt, then every earlier user message followed by the "
        "server's own answer to it, then the turn's user message.",
        "generator": {
            "seed": args.seed,
            "token_ids": list(model.token_ids),
            "excluded_ids": model.excluded_ids,
            "system_tokens": args.system_tokens,
            "conversations": args.conversations,
            "turns": args.turns,
            "user_tokens": [low, high],
            "model": model.name,
            "command": f"python benches/prefix_cache.py --write-trace PATH --model {model.name} "
            f"--seed {args.seed} --system-tokens {args.system_tokens} --conversations "
            f"{args.conversations} --turns {args.turns} --user-tokens {low} {high} "
            f"--max-tokens {args.max_tokens}",
        },
        "max_tokens": args.max_tokens,
        "system": system,
        "conversations": conversations,
    }


def trace_file_text(data: dict[str, Any]) -> str:
    """JSON with one line per id list, so that a diff of the file stays readable."""
    ids = lambda xs: json.dumps(xs, separators=(",", ":"))
    head = {k: v for k, v in data.items() if k not in ("system", "conversations")}
    lines = ["{"]
    for key, value in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, sort_keys=True)},")
    lines.append(f'  "system": {ids(data["system"])},')
    lines.append('  "conversations": [')
    for c, turns in enumerate(data["conversations"]):
        lines.append("    [")
        lines += [f"      {ids(u)}{',' if t + 1 < len(turns) else ''}" for t, u in enumerate(turns)]
        lines.append("    ]" + ("," if c + 1 < len(data["conversations"]) else ""))
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def read_trace(path: Path) -> tuple[AgentTrace, dict[str, Any], str]:
    """The trace in a file, the file's other fields, and the SHA-256 of its bytes."""
    data, sha = read_trace_file(path, TRACE_SCHEMA)
    ok_ids = lambda xs: isinstance(xs, list) and xs and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in xs
    )  # fmt: skip
    conversations = data.get("conversations")
    if not ok_ids(data.get("system")):
        raise TraceError(f"{path}: 'system' must be a non-empty list of token ids")
    if not isinstance(conversations, list) or not conversations:
        raise TraceError(f"{path}: 'conversations' must be a non-empty list")
    for c, turns in enumerate(conversations):
        if not isinstance(turns, list) or not turns or not all(ok_ids(u) for u in turns):
            raise TraceError(
                f"{path}: conversation {c} must be a non-empty list of user messages, each a "
                "non-empty list of token ids"
            )
    check_max_tokens(path, data)
    trace = AgentTrace(data["system"], conversations, data["max_tokens"])
    other = {k: v for k, v in data.items() if k not in ("system", "conversations")}
    return trace, other, sha


# --- one mode, in its own process ----------------------------------------------------------


def warmup_trace(model: common.BenchModel, trace: AgentTrace) -> AgentTrace:
    """The warm-up: one conversation of two short turns, ids of its own (drawn from another
    seed), so that the second turn goes through a cache hit too."""
    n = min(WARMUP_PROMPT_TOKENS, len(trace.system))
    ids = make_trace(
        WARMUP_SEED, 1, (n + 40,) * 2, (1, 1), model.token_ids, model.excluded_ids
    ).prompts[0]
    return AgentTrace(ids[: n - 8] or ids[:1], [[ids[n - 8 : n], ids[n:]]], 2)


class Requests:
    """Every request of a run, in the order they arrived, and the clock of the run."""

    def __init__(self, trace: AgentTrace, clock: Callable[[], float]):
        self.trace, self.clock = trace, clock
        self.history = [list(trace.system) for _ in trace.conversations]  # sent and answered
        self.records: list[dict[str, Any]] = []
        self.t0 = clock()

    def now(self) -> float:
        return self.clock() - self.t0

    def next_prompt(self, conversation: int, turn: int) -> tuple[dict[str, Any], list[int]]:
        """The record and prompt of a conversation's turn (from 0), arriving now."""
        prompt = self.history[conversation] + self.trace.conversations[conversation][turn]
        self.history[conversation] = prompt
        record = {
            "conversation": conversation,
            "turn": turn + 1,
            "prompt_tokens": len(prompt),
            "cached_tokens": None,
            "prefill_tokens": None,
            "arrival_s": self.now(),
            "start_s": None,  # admitted (engine) or taken up (mlx-lm)
            "first_token_s": None,
            "finish_s": None,
            "token_ids": [],
            "text": "",
        }
        self.records.append(record)
        return record, prompt

    def answered(self, record: dict[str, Any]) -> int | None:
        """Record the end of a request; the turn (from 0) that comes next, or None."""
        record["finish_s"] = self.now()
        if len(record["token_ids"]) != self.trace.max_tokens:
            raise WrongOutput(
                f"conversation {record['conversation']} turn {record['turn']}: "
                f"{len(record['token_ids'])} tokens generated, max_tokens is "
                f"{self.trace.max_tokens} (EOS ignored)"
            )
        conversation = record["conversation"]
        self.history[conversation] += record["token_ids"]
        later = record["turn"] < len(self.trace.conversations[conversation])
        return record["turn"] if later else None

    def progress(self, mode: str, record: dict[str, Any]) -> None:
        done = sum(r["finish_s"] is not None for r in self.records)
        total = sum(len(c) for c in self.trace.conversations)
        common.log(
            f"  {mode:>6} [{done:>3}/{total}] conversation {record['conversation']} turn "
            f"{record['turn']}: prompt {record['prompt_tokens']:>5}, cached "
            f"{record['cached_tokens']:>5}, TTFT {record['first_token_s'] - record['arrival_s']:7.2f} s,"
            f" done at {record['finish_s']:7.1f} s"
        )


def serve_engine(
    api, model, tokenizer, trace: AgentTrace, spec: dict, prefix_cache: bool, quiet=False
):
    """The trace, closed-loop, through the solution's Engine on fresh paged pools. Returns
    (records, what the pools and the engine counted)."""
    s = spec["settings"]
    kwargs = {"read_in_place": True} if s["read_in_place"] else {}
    if prefix_cache:  # a solution before Week 4 Day 4 has no such keyword
        kwargs["prefix_cache"] = True
    pools = model.create_kv_pools(s["page_size"], None, **kwargs)
    by_id: dict[int, dict[str, Any]] = {}

    def on_step(step) -> None:
        if step.kind == "admit" and step.request is not None:
            record = by_id.get(step.request.prompt_idx)
            if record is not None and record["start_s"] is None:
                record["start_s"] = requests.now()

    engine = api.Engine(
        model, tokenizer, max_seq_len=trace.max_seq_len, batch_size=s["batch_size"],
        prefill_step=s["prefill_step"], pools=pools, policy=s["policy"], on_step=on_step,
    )  # fmt: skip
    params = api.SamplingParams(max_tokens=trace.max_tokens, ignore_eos=True)
    requests = Requests(trace, time.perf_counter)  # t = 0: every first turn arrives

    def add(conversation: int, turn: int) -> None:
        record, prompt = requests.next_prompt(conversation, turn)
        by_id[engine.add_request(prompt, params)] = record

    for c in range(len(trace.conversations)):
        add(c, 0)
    while engine.has_work:
        outputs = engine.step()
        now = requests.now()
        for out in outputs:
            record = by_id[out.request_id]
            if out.token_ids and record["first_token_s"] is None:
                record["first_token_s"] = now
            record["token_ids"] += out.token_ids
            record["text"] += out.text
            if out.finish_reason is not None:
                record["cached_tokens"] = out.cached_tokens
                record["prefill_tokens"] = out.prompt_tokens - out.cached_tokens
                following = requests.answered(record)
                if not quiet:
                    requests.progress("on" if prefix_cache else "off", record)
                if following is not None:
                    add(record["conversation"], following)
    stats = engine.stats()
    pool = pools[0]
    counts = {
        "prefill_tokens": stats["prompt_tokens_prefilled"],
        "cached_tokens": stats.get("prompt_tokens_cached"),
        "decoded_tokens": stats["tokens_decoded"],
        "preemptions": stats["preemptions"],
        "peak_pages": pool.peak_in_use,
        "pages_created": pool.num_pages,
        "pages_cached_end": stats.get("pages_cached"),
        "pages_in_use_end": stats["pages_in_use"],
        "evictions": getattr(pool, "evictions", None),
    }
    return requests.records, counts


def serve_mlx_lm(model, trace: AgentTrace, quiet=False):
    """The trace, closed-loop, through mlx-lm one request at a time, as mlx_lm.server's
    unbatched path serves it: the nearest cached prefix from its LRUPromptCache (a deep copy,
    trimmed when it came from a longer prompt), stream_generate over the rest of the prompt
    with that cache, then the cache inserted back under prompt + answer. Requests are taken
    up in the order they arrive. Returns (records, what the prompt cache held at the end)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tokenizer = TokenizerWrapper(IdsOnlyTokenizer(), eos_token_ids=[])  # EOS ignored
    store = LRUPromptCache()  # mlx_lm.server's default size (--prompt-cache-size 10)
    requests = Requests(trace, time.perf_counter)
    queue = deque(requests.next_prompt(c, 0) for c in range(len(trace.conversations)))
    while queue:
        record, prompt = queue.popleft()
        record["start_s"] = requests.now()
        cache, rest = store.fetch_nearest_cache(MLX_LM_MODEL_KEY, prompt)
        if not rest:
            raise RuntimeError("a prompt of the trace was cached whole: nothing to prefill")
        record["cached_tokens"] = len(prompt) - len(rest)
        record["prefill_tokens"] = len(rest)
        if cache is None:
            cache = make_prompt_cache(model)
        key = list(prompt)
        for response in stream_generate(
            model, tokenizer, rest, max_tokens=trace.max_tokens, prompt_cache=cache
        ):
            if record["first_token_s"] is None:
                record["first_token_s"] = requests.now()
            record["token_ids"].append(response.token)
            key.append(response.token)
            if response.finish_reason is not None:
                break
        following = requests.answered(record)
        store.insert_cache(MLX_LM_MODEL_KEY, key, cache)
        if not quiet:
            requests.progress("mlx-lm", record)
        if following is not None:
            queue.append(requests.next_prompt(record["conversation"], following))
    records = requests.records
    counts = {
        "prefill_tokens": sum(r["prefill_tokens"] for r in records),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "prompt_cache_entries_end": len(store),
        "prompt_cache_bytes_end": store.nbytes,
    }
    return records, counts


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    with common.child_errors(
        spec["settings"]["solution"], (WrongOutput,), f"mode {spec['mode']}: "
    ):
        result = measure_one(spec)
    common.write_json(spec["output"], result)
    return 0


def measure_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the model, warm up on throwaway caches, serve the trace once; the run's result."""
    t0 = time.perf_counter()
    s, mode = spec["settings"], spec["mode"]
    device = choose_device(s["device"])
    trace = AgentTrace(**spec["trace"])
    if trace.sha256() != spec["trace_sha256"]:
        raise RuntimeError("the trace handed to this process does not match its SHA-256")
    bench_model, ckpt = common.load_weights(spec["model"], s["dtype"])
    warm = warmup_trace(bench_model, trace)
    if mode == "mlx-lm":
        model = mlx_lm_qwen3(ckpt)
        run = lambda t, quiet=False: serve_mlx_lm(model, t, quiet)
    else:
        api = load_solution(s["solution"])
        longest = max(trace.max_seq_len, warm.max_seq_len)
        model = api.Qwen3Model(ckpt, max_seq_len=longest)
        tokenizer = ckpt.tokenizer or NoTextTokenizer()
        run = lambda t, quiet=False: serve_engine(
            api, model, tokenizer, t, spec, mode == "on", quiet
        )
    load_s = time.perf_counter() - t0
    t = time.perf_counter()
    run(warm, quiet=True)  # on caches of its own
    warmup_s = time.perf_counter() - t
    mx.clear_cache()
    mx.reset_peak_memory()
    records, counts = run(trace)
    return {
        "mode": mode,
        **common.planned_run(spec),
        "device": device,
        "blas": common.process_blas(),
        "load_s": load_s,
        "warmup_s": warmup_s,
        "peak_memory_bytes": mx.get_peak_memory(),
        "metrics": run_metrics(records, counts),
        "counts": counts,
        "requests": records,
    }


# --- numbers of one run ---------------------------------------------------------------------


def _ttft(records: Sequence[dict[str, Any]]) -> list[float]:
    return [r["first_token_s"] - r["arrival_s"] for r in records]


def _ms(values: Sequence[float], q: float) -> float | None:
    p = common.percentile(values, q)
    return None if p is None else p * 1000


def run_metrics(records: list[dict[str, Any]], counts: dict[str, Any]) -> dict[str, Any]:
    """The run's scalar numbers (times in ms unless named _s) and its per-turn lists."""
    first = [r for r in records if r["turn"] == 1]
    later = [r for r in records if r["turn"] > 1]
    turns = max(r["turn"] for r in records)
    wall = max(r["finish_s"] for r in records)
    generated = sum(len(r["token_ids"]) for r in records)
    prompt = sum(r["prompt_tokens"] for r in records)
    by_turn = [[r for r in records if r["turn"] == t] for t in range(1, turns + 1)]
    return {
        "requests": len(records),
        "wall_s": wall,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / wall,
        "prompt_tokens": prompt,
        "prefill_tokens": counts["prefill_tokens"],
        "cached_tokens": counts["cached_tokens"],
        "prefill_fraction": counts["prefill_tokens"] / prompt,
        "ttft_turn1_ms_p50": _ms(_ttft(first), 50),
        "ttft_turn1_ms_p95": _ms(_ttft(first), 95),
        "ttft_later_ms_p50": _ms(_ttft(later), 50),
        "ttft_later_ms_p95": _ms(_ttft(later), 95),
        "wait_later_ms_p50": _ms([r["start_s"] - r["arrival_s"] for r in later], 50),
        "peak_pages": counts.get("peak_pages"),
        "by_turn": {
            "ttft_ms_p50": [_ms(_ttft(rs), 50) for rs in by_turn],
            "ttft_ms_p95": [_ms(_ttft(rs), 95) for rs in by_turn],
            "prompt_tokens": [sum(r["prompt_tokens"] for r in rs) for rs in by_turn],
            "prefill_tokens": [sum(r["prefill_tokens"] for r in rs) for rs in by_turn],
        },
    }


SCALARS = (
    "wall_s",
    "generated_tokens",
    "generated_tokens_per_s",
    "prompt_tokens",
    "prefill_tokens",
    "cached_tokens",
    "prefill_fraction",
    "ttft_turn1_ms_p50",
    "ttft_turn1_ms_p95",
    "ttft_later_ms_p50",
    "ttft_later_ms_p95",
    "wait_later_ms_p50",
    "peak_pages",
)


# --- the parent: plan, launch, aggregate, report -------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = common.bench_parser("bench-prefix-cache", DESCRIPTION)
    common.add_model_arguments(p, "qwen3-0.6b", default_layers=DEFAULT_LAYERS)
    t = p.add_argument_group("trace")
    t.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE,
        help="the trace file; the committed one is checked against its SHA-256",
    )  # fmt: skip
    for flag, what in (  # how much of the trace to use; with --write-trace, how much to make
        ("--conversations", "use the first N conversations (default all); with --write-trace: how many (8)"),
        ("--turns", "use each conversation's first N turns (default all); with --write-trace: 4"),
        ("--system-tokens", "use the system prompt's first N tokens (default all); with --write-trace: 1024"),
        ("--max-tokens", "tokens per answer (default: the trace's); with --write-trace: 16"),
    ):  # fmt: skip
        t.add_argument(flag, type=int_at_least(1), default=None, help=what)
    t.add_argument(
        "--write-trace", type=Path, default=None, metavar="PATH",
        help="write a new trace for --model's ordinary token ids and exit",
    )  # fmt: skip
    t.add_argument(
        "--user-tokens", type=int_at_least(1), nargs=2, default=[32, 64], metavar=("MIN", "MAX"),
        help="with --write-trace: user message lengths, uniform in [MIN, MAX]",
    )  # fmt: skip
    t.add_argument(
        "--seed", type=int_at_least(0), default=0, help="random weights (and a new trace)"
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--policy", choices=("hybrid", "alternate"), default="hybrid",
        help="the scheduler of both engine modes (Week 3 Days 2 and 4)",
    )  # fmt: skip
    for flag, default, what in (
        ("--page-size", 16, "tokens per page, in both engine modes (only full pages are shared)"),
        ("--batch-size", 8, "decode slots"),
        ("--prefill-step", 128, "prompt tokens per iteration (hybrid: decode rows included)"),
    ):
        e.add_argument(flag, type=int_at_least(1), default=default, help=what)
    e.add_argument(
        "--read-in-place", action="store_true", help="pages read in place (Week 3 Day 5)"
    )
    r = p.add_argument_group("runs and output")
    r.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES),
        help="off: engine on plain pools; on: engine with prefix_cache=True; mlx-lm: its "
        "prompt cache, one request at a time",
    )  # fmt: skip
    common.add_repeats_argument(r, "mode", 1)
    common.add_output_arguments(
        r, "prefix-cache-<model>-<layers>layers-<os>-<arch>-<N>cpu.json", plot=True
    )
    common.add_child_spec_argument(p)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> common.BenchModel:
    """Every check that needs no weights; errors exit through argparse before any run."""
    if args.user_tokens[0] > args.user_tokens[1]:
        p.error(f"--user-tokens: MIN {args.user_tokens[0]} > MAX {args.user_tokens[1]}")
    if len(set(args.modes)) != len(args.modes):
        p.error("--modes lists a mode more than once")
    if args.write_trace is None and args.user_tokens != [32, 64]:
        p.error("--user-tokens only applies with --write-trace")
    return common.bench_model_from_args(p, args, default_layers=DEFAULT_LAYERS)


def load_trace(
    p: argparse.ArgumentParser, args, model: common.BenchModel
) -> tuple[AgentTrace, dict]:
    """The trace to serve (the file's, cut as asked) and what the report says of the file."""
    try:
        full, other, file_sha = read_trace(args.trace)
    except TraceError as e:
        p.error(str(e))
    default = (DEFAULT_TRACE, DEFAULT_TRACE_SHA256)
    committed = is_committed_trace(
        p, args.trace, file_sha, default, "regenerate it with --write-trace"
    )
    trace = full.cut(args.conversations, args.turns, args.system_tokens)
    if args.max_tokens is not None:
        trace.max_tokens = args.max_tokens
    vocab = int(model.config["vocab_size"])
    high = max([*trace.system, *(t for c in trace.conversations for u in c for t in u)])
    if high >= vocab:
        p.error(
            f"the trace has token id {high}, outside the vocabulary of {model.name} "
            f"({vocab} ids); make a trace for it with --write-trace"
        )
    limit = int(model.config["max_position_embeddings"])
    if trace.max_seq_len > limit:
        p.error(f"the trace's longest request ({trace.max_seq_len} tokens) exceeds {limit}")
    about = {
        "path": common.relative_path(args.trace),
        "file_sha256": file_sha,
        "is_committed_trace": committed,
        "file": {k: v for k, v in other.items() if k != "about"},
        "file_shape": {
            "system_tokens": len(full.system),
            "conversations": len(full.conversations),
            "turns": full.turns,
            "max_tokens": full.max_tokens,
        },
        "used": trace.describe(),
    }
    return trace, about


def run_child(tmp: Path, k: int, total: int, env: dict[str, str], spec: dict) -> dict[str, Any]:
    """One run in a fresh process: its result, with the time the whole process took."""
    mode, repeat = spec["mode"], spec["repeat"]
    common.log(f"[{k + 1}/{total}] mode {mode}, repeat {repeat + 1} ({spec['order']})")
    run = common.run_fresh(
        Path(__file__).resolve(), tmp, k, total, env, spec, f"mode {mode}, repeat {repeat + 1}"
    )
    m = run["metrics"]
    common.log(
        f"[{k + 1}/{total}] mode {mode}: {run['process_s']:.1f} s in process (load {run['load_s']:.1f}, "
        f"warm-up {run['warmup_s']:.1f}), run {m['wall_s']:.1f} s, prefilled "
        f"{m['prefill_tokens']} of {m['prompt_tokens']} prompt tokens, TTFT p50 turn 1 "
        f"{m['ttft_turn1_ms_p50']:.0f} ms, later {_fmt(m['ttft_later_ms_p50'])} ms, "
        f"blas {run['blas']['blas']}, core {run['blas']['openblas_core']}"
    )
    return run


def token_agreement(runs: list[dict[str, Any]]) -> None:
    """Add to every run whether its generated ids equal those of the first cache-off run
    (None without one), request by request, and where they first differ."""
    base = next((r for r in runs if r["mode"] == "off"), None)
    want = None if base is None else {(q["conversation"], q["turn"]): q for q in base["requests"]}
    for run in runs:
        if want is None:
            run["agreement_with_off"] = None
            continue
        same, differ, first = 0, 0, None
        for q in run["requests"]:
            other = want.get((q["conversation"], q["turn"]))
            if other is not None and other["token_ids"] == q["token_ids"]:
                same += 1
                continue
            differ += 1
            if first is None and other is not None:
                at = common.first_difference(q["token_ids"], other["token_ids"], None)
                first = {"conversation": q["conversation"], "turn": q["turn"], "token": at}
        texts = all(
            want.get((q["conversation"], q["turn"]), {}).get("text") == q["text"]
            for q in run["requests"]
        )
        run["agreement_with_off"] = {
            "same_token_ids": differ == 0 and len(run["requests"]) == len(want),
            "same_text": texts and len(run["requests"]) == len(want),
            "requests_same": same,
            "requests_different": differ,
            "first_difference": first,
        }


def aggregate(runs: list[dict[str, Any]], modes: Sequence[str]) -> dict[str, Any]:
    """Per mode: the median over its runs of every scalar and per-turn number, min and max
    of the scalars, and whether every run's ids equal cache-off's."""
    out = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        metrics = [r["metrics"] for r in mine]
        turns = len(metrics[0]["by_turn"]["ttft_ms_p50"])
        row: dict[str, Any] = {"runs": len(mine)}
        row["median"] = {k: common.median(m[k] for m in metrics) for k in SCALARS}
        row["min"] = {k: common.least(m[k] for m in metrics) for k in SCALARS}
        row["max"] = {k: common.greatest(m[k] for m in metrics) for k in SCALARS}
        row["by_turn_median"] = {
            key: [common.median(m["by_turn"][key][t] for m in metrics) for t in range(turns)]
            for key in metrics[0]["by_turn"]
        }
        agreements = [r["agreement_with_off"] for r in mine]
        row["same_token_ids_as_off"] = (
            None if None in agreements else all(a["same_token_ids"] for a in agreements)
        )
        row["same_text_as_off"] = (
            None if None in agreements else all(a["same_text"] for a in agreements)
        )
        out[mode] = row
    return out


def targets(modes: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, cache on against cache off (None where a mode did not run)."""
    if "off" not in modes or "on" not in modes:
        return {"checked": False, "why": "needs both the off and the on mode"}
    off, on = modes["off"]["median"], modes["on"]["median"]
    fraction = on["prefill_tokens"] / off["prefill_tokens"]
    speedup = (
        off["ttft_later_ms_p50"] / on["ttft_later_ms_p50"]
        if off["ttft_later_ms_p50"] is not None and on["ttft_later_ms_p50"]
        else None
    )
    same = modes["on"]["same_token_ids_as_off"]
    result = {
        "checked": True,
        "prefill_tokens_on_over_off": {
            "value": fraction,
            "at_most": TARGET_PREFILL_FRACTION,
            "met": fraction <= TARGET_PREFILL_FRACTION,
        },
        "ttft_later_turns_p50_off_over_on": {
            "value": speedup,
            "at_least": TARGET_TTFT_SPEEDUP,
            "met": speedup is not None and speedup >= TARGET_TTFT_SPEEDUP,
        },
        "generated_ids_on_equal_off": {"value": same, "met": bool(same)},
    }
    result["all_met"] = all(v["met"] for v in result.values() if isinstance(v, dict))
    if "mlx-lm" in modes:  # reported beside the targets, not one of them
        ml = modes["mlx-lm"]["median"]
        result["mlx_lm_for_comparison"] = {
            "prefill_tokens_over_off": ml["prefill_tokens"] / off["prefill_tokens"],
            "ttft_later_turns_p50_over_on": (
                ml["ttft_later_ms_p50"] / on["ttft_later_ms_p50"]
                if ml["ttft_later_ms_p50"] is not None and on["ttft_later_ms_p50"]
                else None
            ),
            "same_token_ids_as_off": modes["mlx-lm"]["same_token_ids_as_off"],
        }
    return result


def default_json_path(model: common.BenchModel) -> Path:
    return (
        common.RESULTS
        / f"prefix-cache-{common.model_slug(model)}-{model.num_layers}layers-{common.host_slug()}.json"
    )


def run_benchmark(
    args: argparse.Namespace, model: common.BenchModel, trace: AgentTrace, about: dict
):
    started = time.time()
    env, preloaded = common.runs_environment(args.no_openblas)
    core = common.runs_openblas_core(env, preloaded)
    plan = common.plan_runs(args.modes, args.repeats)
    settings = {
        "policy": args.policy,
        "page_size": args.page_size,
        "batch_size": args.batch_size,
        "prefill_step": args.prefill_step,
        "read_in_place": args.read_in_place,
        "max_seq_len": trace.max_seq_len,
        "dtype": args.dtype,
        "device": args.device,
        "solution": args.solution,
    }
    used = about["used"]
    common.log_model(model, args)
    common.log(
        f"trace {about['path']} (file sha256 {about['file_sha256'][:16]}...): system "
        f"{used['system_tokens']} tokens, {used['conversations']} conversations x "
        f"{used['turns']} turns, answers of {used['max_tokens']} tokens"
    )
    common.log_runs_blas(preloaded, core)
    common.log(f"{len(plan)} runs: modes {args.modes} x {args.repeats} repeat(s)")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-prefix-cache-") as tmp:
        common.write_random_weights(model, Path(tmp), args.dtype)
        shared = {
            "model": model.to_dict(),
            "trace": trace.to_dict(),
            "trace_sha256": trace.sha256(),
            "settings": settings,
        }
        for k, (repeat, order, mode) in enumerate(plan):
            spec = {**shared, "mode": mode, "repeat": repeat, "order": order}
            runs.append(run_child(Path(tmp), k, len(plan), env, spec))
        model_description = model.describe()
    token_agreement(runs)
    modes = aggregate(runs, args.modes)
    return {
        **common.report_start(
            SCHEMA, started, common.arguments_json(args, leave_out=("child_spec",))
        ),
        **common.runs_settings(args, runs),
        "blas": common.runs_blas(runs, env, preloaded, core),
        "environment": common.environment(),
        "model": model_description,
        "trace": about,
        "settings": settings,
        "mlx_lm": mlx_lm_settings() if "mlx-lm" in args.modes else None,
        "definitions": DEFINITIONS,
        "plan": [{"repeat": r, "order": o, "mode": m} for r, o, m in plan],
        "runs": runs,
        "modes": modes,
        "targets": targets(modes),
    }


def summary_table(report: dict[str, Any]) -> str:
    lines = [  # the column heads, then a row each
        f"{'mode':>7} {'runs':>4} {'prefilled':>9} {'cached':>7} {'of prompt':>9} "
        f"{'TTFT t1 p50':>11} {'p95':>8} {'TTFT t2+ p50':>12} {'p95':>8} {'wall s':>7} "
        f"{'tok/s':>6} {'peak pg':>7} {'ids = off':>9}"
    ]
    for mode, row in report["modes"].items():
        m = row["median"]
        lines.append(
            f"{mode:>7} {row['runs']:>4} {m['prefill_tokens']:>9.0f} {m['cached_tokens']:>7.0f} "
            f"{m['prefill_fraction']:>9.1%} {_fmt(m['ttft_turn1_ms_p50']):>11} "
            f"{_fmt(m['ttft_turn1_ms_p95']):>8} {_fmt(m['ttft_later_ms_p50']):>12} "
            f"{_fmt(m['ttft_later_ms_p95']):>8} {m['wall_s']:>7.1f} "
            f"{m['generated_tokens_per_s']:>6.2f} {_fmt(m['peak_pages']):>7} "
            f"{str(row['same_token_ids_as_off']):>9}"
        )
    lines.append("(TTFT in ms, medians over runs; t2+: turns 2 and later)")
    t = report["targets"]
    if t.get("checked"):
        for name in (
            "prefill_tokens_on_over_off",
            "ttft_later_turns_p50_off_over_on",
            "generated_ids_on_equal_off",
        ):
            v = t[name]
            bound = (
                f" (at most {v['at_most']})" if "at_most" in v
                else f" (at least {v['at_least']})" if "at_least" in v else ""
            )  # fmt: skip
            value = f"{v['value']:.3f}" if isinstance(v["value"], float) else str(v["value"])
            lines.append(f"target {name}: {value}{bound}: {'met' if v['met'] else 'NOT met'}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Left: p50 TTFT per turn (bars to p95) for each mode, log scale. Right: prompt tokens
    computed per turn (all conversations), each mode beside the prompt tokens sent."""
    plt = common.pyplot()
    if plt is None:
        return None
    modes = report["modes"]
    colors = {"off": "tab:red", "on": "tab:green", "mlx-lm": "tab:blue"}
    labels = {
        "off": "engine, cache off",
        "on": "engine, prefix cache",
        "mlx-lm": "mlx-lm prompt cache",
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for mode, row in modes.items():
        p50 = row["by_turn_median"]["ttft_ms_p50"]
        p95 = row["by_turn_median"]["ttft_ms_p95"]
        turns = list(range(1, len(p50) + 1))
        s50 = [v / 1000 for v in p50]
        err = [[0] * len(p50), [(b - a) / 1000 for a, b in zip(p50, p95)]]
        left.errorbar(
            turns,
            s50,
            yerr=err,
            fmt="o-",
            capsize=3,
            color=colors.get(mode),
            label=labels.get(mode, mode),
        )
    left.set_yscale("log")
    left.set_xlabel("turn")
    left.set_xticks(turns)
    left.set_ylabel("time to first token (s): p50, bar to p95")
    left.set_title("TTFT per turn (a turn's clock starts on arrival)")
    left.legend(fontsize=8, loc="best")
    names = list(modes)
    width = 0.8 / (len(names) + 1)
    sent_by = "off" if "off" in modes else names[0]  # mlx-lm's own answers may differ
    sent = modes[sent_by]["by_turn_median"]["prompt_tokens"]
    xs = range(len(sent))
    right.bar(
        list(xs), sent, width=width, color="lightgray", label=f"prompt tokens sent ({sent_by})"
    )
    for i, mode in enumerate(names, start=1):
        right.bar(
            [x + i * width for x in xs],
            modes[mode]["by_turn_median"]["prefill_tokens"],
            width=width,
            color=colors.get(mode),
            label=f"computed: {labels.get(mode, mode)}",
        )
    right.set_xticks([x + width * len(names) / 2 for x in xs])
    right.set_xticklabels([f"turn {x + 1}" for x in xs])
    right.set_yscale("log")
    right.set_ylim(top=max(sent) * 12)  # room for the legend above the bars
    right.set_ylabel("prompt tokens, all conversations (log)")
    right.set_title("prompt tokens prefilled per turn")
    right.legend(fontsize=7, loc="upper center", ncol=2)
    m = report["model"]
    used = report["trace"]["used"]
    title = (
        f"prefix caching: {m['name']} ({m['num_layers']} layers), {report['dtype']}, "
        f"{used['conversations']} conversations x {used['turns']} turns, system "
        f"{used['system_tokens']} tokens, policy {report['settings']['policy']}"
    )
    return common.save_figure(fig, path, title)


def mlx_lm_settings() -> dict[str, Any]:
    """How the mlx-lm mode serves: its version and the defaults it runs with."""
    import inspect

    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import LRUPromptCache

    step = inspect.signature(generate_step).parameters["prefill_step_size"].default
    return {
        "version": common.package_version("mlx-lm"),
        "serving": "one request at a time, in arrival order: LRUPromptCache.fetch_nearest_cache, "
        "stream_generate(prompt_cache=...) over the rest of the prompt, insert_cache(prompt + "
        "answer); greedy, EOS ignored",
        "prompt_cache_max_size": LRUPromptCache().max_size,
        "prefill_step_size": step,
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def write_trace(args: argparse.Namespace, model: common.BenchModel) -> int:
    args.conversations = args.conversations or 8
    args.turns = args.turns or 4
    args.system_tokens = args.system_tokens or 1024
    args.max_tokens = args.max_tokens or 16
    write_trace_file(args.write_trace, trace_file_text(make_agent_trace(args, model)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = common.parse_args_or_run(parser, argv, child_main)
    model = check_args(parser, args)
    if args.write_trace is not None:
        common.check_outputs(parser, args.write_trace)
        return write_trace(args, model)
    trace, about = load_trace(parser, args, model)
    common.set_output_paths(parser, args, default_json_path(model))
    report = run_benchmark(args, model, trace, about)
    common.write_report(args, report, summary_table, plot)
    return 0


if __name__ == "__main__":
    sys.exit(startup.run(main))

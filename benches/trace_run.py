"""A request trace (prompts as token ids, an output budget per request) and one run of it: the
solution's own batch_generate (or mlx-lm's BatchGenerator) serves the whole trace at once, every
request exactly its budget (ignore_eos=True), watched only through on_step (BatchRecorder).

Also what the benchmarks on committed trace files share (prefix_cache, speculative).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
from collections import namedtuple
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from benches.harness import canonical_sha256, first_difference, log, replace_file, summarize
from tiny_llm_support.batch_recorder import BatchRecorder


class WrongOutput(RuntimeError):
    """A run did not generate what it was asked for."""


class TraceError(ValueError):
    """A trace file that cannot be used; the message says why."""


class TraceContent:
    """A dataclass whose fields are a whole trace (Trace(**d) makes it again), and its name."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def sha256(self) -> str:
        return canonical_sha256(self.to_dict())


@dataclass
class Trace(TraceContent):
    prompts: list[list[int]]
    output_budgets: list[int]  # how many tokens each request must generate

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_budgets)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + b for p, b in zip(self.prompts, self.output_budgets))


def make_trace(
    seed: int, num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int],
    token_ids: tuple[int, int], excluded_ids: Sequence[int] = (),
) -> Trace:  # fmt: skip
    """Lengths uniform in the closed ranges, ids uniform over [low, high) less `excluded_ids`.
    Python's `random` keeps its stream stable across versions: a seed names the same trace
    everywhere."""
    excluded = set(excluded_ids)
    allowed = [i for i in range(*token_ids) if i not in excluded]
    if not allowed:
        raise ValueError("no token ids to draw prompts from")
    rng = random.Random(seed)
    prompts, budgets = [], []
    for _ in range(num_seqs):
        length = rng.randint(*input_len)
        budgets.append(rng.randint(*output_len))
        prompts.append([rng.choice(allowed) for _ in range(length)])
    return Trace(prompts, budgets)


class NoTextTokenizer:
    """The tokenizer of prompts that are ids already, whose answers need no text (a random-weight
    model has none): batch_generate's, with no EOS (ignore_eos=True) and itself as a detokenizer
    that keeps nothing; and in mlx-lm's TokenizerWrapper (mlx_lm_tokenizer), a Hugging Face
    tokenizer with no vocabulary (so no thinking tokens), no chat template, no EOS of its own."""

    eos_token_ids: frozenset[int] = frozenset()
    eos_token_id = chat_template = None
    clean_up_tokenization_spaces = False
    text = ""

    def detokenizer(self) -> NoTextTokenizer:
        return self

    def add_token(self, token_id: int) -> None:
        pass

    def finalize(self) -> None:
        pass

    def get_vocab(self) -> dict[str, int]:
        return {}

    def decode(self, ids, **kwargs) -> str:
        return ""


def serve(
    api: ModuleType, model: Any, trace: Trace, options: dict[str, Any], pools: list | None = None
) -> dict[str, Any]:
    """api.batch_generate(**options) on the trace, on the paged caches `pools` where given."""
    rec = BatchRecorder()
    api.batch_generate(
        model, NoTextTokenizer(), trace.prompts, max_seq_len=trace.max_seq_len,
        max_new_tokens=trace.output_budgets, ignore_eos=True, on_step=rec.on_step, pools=pools,
        **options,
    )  # fmt: skip
    return measured(rec, trace, "batch_generate")


@dataclass
class _Seen:
    """A request of the mlx-lm run, shaped like the course's Request for the recorder."""

    prompt_idx: int
    prompt_tokens: list[int]
    prefilled: int = 0
    finished: bool = False
    generated: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()


_Step = namedtuple("_Step", "kind request slots tokens forward_pass")  # a BatchStep


def serve_mlx_lm(model: Any, trace: Trace, batch_size: int, prefill_step: int) -> dict[str, Any]:
    """mlx-lm's BatchGenerator on the trace, one prompt prefilled at a time. Each next() (one
    decode step, then one prompt chunk) is reported as one pass: its decode gaps include the
    chunk work, as for the course's alternate policy."""
    from mlx_lm.generate import BatchGenerator

    rec = BatchRecorder()
    gen = BatchGenerator(
        model, max_tokens=max(trace.output_budgets), completion_batch_size=batch_size,
        prefill_batch_size=1, prefill_step_size=prefill_step,
    )  # fmt: skip
    uids = gen.insert(trace.prompts, list(trace.output_budgets))
    seen = {uid: _Seen(i, prompt) for i, (uid, prompt) in enumerate(zip(uids, trace.prompts))}
    passes = 0
    while not all(r.finished for r in seen.values()):
        prompt_responses, generation_responses = gen.next()
        passes += 1
        running = [r for r in seen.values() if r.generated and not r.finished]
        for response in prompt_responses:
            request = seen[response.uid]
            tokens = response.progress[0] - request.prefilled
            request.prefilled = response.progress[0]
            if tokens > 0:
                rec.on_step(_Step("prefill", request, running, tokens, passes))
        decoding = [seen[r.uid] for r in generation_responses]
        for request, response in zip(decoding, generation_responses):
            request.generated.append(response.token)
        if decoding:
            rec.on_step(_Step("decode", None, decoding, len(decoding), passes))
        for request, response in zip(decoding, generation_responses):
            if response.finish_reason is not None:
                request.finished = True
                rec.on_step(_Step("finish", request, running, 0, passes))
    gen.close()
    return measured(rec, trace, "mlx-lm's BatchGenerator")


def measured(rec: BatchRecorder, trace: Trace, server: str) -> dict[str, Any]:
    """The run's "metrics" and "raw" times, once each request generated exactly its budget."""
    rec.stop()
    n = len(trace.prompts)
    refused = sorted(i for i, r in rec.requests.items() if r.stop == "refused")
    generated = [rec.requests[i].generated if i in rec.requests else 0 for i in range(n)]
    want = [0 if i in refused else b for i, b in enumerate(trace.output_budgets)]
    if generated != want:
        raise WrongOutput(
            f"{server} generated {generated} tokens for budgets {trace.output_budgets}: "
            "it must stop each request after exactly max_new_tokens, and ignore EOS when asked"
        )
    requests = [rec.requests[i] for i in range(n) if i in rec.requests]
    times = {  # seconds
        "decode_step": [p.duration for p in rec.decode_passes()],
        "decode_gap": [g.seconds for g in rec.decode_gaps()],
        "prefill_chunk": [p.duration for p in rec.prefill_passes()],
        "ttft": [r.ttft for r in requests],
        "finish": [r.finished for r in requests],
    }
    served_prompts = sum(len(p) for i, p in enumerate(trace.prompts) if i not in refused)
    metrics = {
        "wall_s": rec.wall, "requests": n, "prompt_tokens": trace.prompt_tokens,
        "output_tokens": sum(want), "output_tokens_per_s": rec.output_tokens_per_s(),
        "requests_per_s": (n - len(refused)) / rec.wall,  # requests served, not refused
        "decode_steps": len(times["decode_step"]), "decode_tokens": rec.decode_tokens(),
        "decode_gaps": len(times["decode_gap"]),
        "prefill_chunks": sum(len(r.chunks) for r in requests), "refused": len(refused),
        "preemptions": sum(r.preemptions for r in requests),
        "recomputed_tokens": rec.prefill_tokens() - served_prompts,
    }  # fmt: skip
    for name in ("decode_step", "decode_gap", "ttft", "prefill_chunk"):
        ms = summarize([t for t in times[name] if t is not None], 1e3)
        metrics |= {f"{name}_ms_{stat}": ms[stat] for stat in ("median", "p95", "max")}
    raw = {f"{name}_s": [t if t is None else round(t, 6) for t in ts] for name, ts in times.items()}
    return {"metrics": metrics, "raw": raw}


# --- committed trace files ---------------------------------------------------------------


def read_trace_file(
    path: Path, schema: str, problem: Callable[[dict[str, Any]], str | None]
) -> tuple[dict[str, Any], str]:
    """A trace file's JSON and the SHA-256 of its bytes; problem(data) says what it lacks."""
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read the trace {path}: {e}") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        raise TraceError(f"{path} is not a trace of schema {schema}")
    if (lacks := problem(data)) is not None:
        raise TraceError(f"{path}: {lacks}")
    max_tokens = data.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise TraceError(f"{path}: 'max_tokens' must be an integer >= 1")
    return data, hashlib.sha256(raw).hexdigest()


def is_token_ids(ids: Any) -> bool:
    """A non-empty list of integers >= 0."""
    return isinstance(ids, list) and bool(ids) and all(type(t) is int and t >= 0 for t in ids)


def load_trace(
    p: argparse.ArgumentParser, path: Path, read: Callable[[Path], tuple],
    committed: tuple[Path, str], remake: str,
) -> tuple:  # fmt: skip
    """read(path) (ending with the file's SHA-256), and whether it is the committed trace at
    `committed` = (path, SHA-256): argparse's error for a file that cannot be used, or for the
    committed one with other bytes (results under one name come from one trace)."""
    try:
        read_back = read(path)
    except TraceError as e:
        p.error(str(e))
    sha, (committed_path, committed_sha) = read_back[-1], committed
    is_committed = path.resolve() == committed_path
    if is_committed and sha != committed_sha:
        p.error(
            f"{path} has SHA-256 {sha}, the committed trace has {committed_sha}: the trace file "
            f"changed ({remake} and update DEFAULT_TRACE_SHA256 together)"
        )
    return (*read_back, is_committed)


def trace_text(head: dict[str, Any], body: dict[str, str]) -> str:
    """A trace file's text, a field a line (a diff stays readable); `body`: JSON text."""
    fields = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in head.items()]
    fields += [f"  {json.dumps(k)}: {text}" for k, text in body.items()]
    return "{\n" + ",\n".join(fields) + "\n}\n"


def write_trace_file(path: Path, text: str) -> None:
    """A new trace file (ASCII), and a line with its SHA-256 (for DEFAULT_TRACE_SHA256)."""
    replace_file(path, text, encoding="ascii")
    log(f"wrote {path}: sha256 {hashlib.sha256(text.encode('ascii')).hexdigest()}")


def mlx_lm_tokenizer(eos_token_ids: Sequence[int] = ()) -> Any:
    """For stream_generate on prompts of ids; no `eos_token_ids`: EOS ignored."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(NoTextTokenizer(), eos_token_ids=sorted(eos_token_ids))


def compare_answers(answers: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict:
    """How many answers' "ids" and "texts" differ from the reference's, and "first": None or
    (the first answer whose ids differ, the first token where they do)."""
    pairs = list(zip(answers, reference))
    differ = [i for i, (a, b) in enumerate(pairs) if a["token_ids"] != b["token_ids"]]
    first = None
    if differ:
        a, b = (answer["token_ids"] for answer in pairs[differ[0]])
        first = (differ[0], first_difference(a, b, min(len(a), len(b))))
    texts = sum(a["text"] != b["text"] for a, b in pairs)
    return {"ids": len(differ), "texts": texts, "first": first}

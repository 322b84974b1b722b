"""bench-speculative's modes (parse_mode) and how a mode serves a trace's prompts in a run's own
process: the Engine with the mode's proposer, or mlx-lm's stream_generate; a row of numbers each."""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from typing import Any

from benches import trace_run
from tiny_llm_support import Checkpoint
from tiny_llm_support.cli import load_solution

MODE_PATTERN = re.compile(
    r"^(?P<mlx>mlx-lm-)?(?:(?P<plain>plain)|lookup-k(?P<lk>\d+)"
    r"|draft-(?:(?P<self>self)|(?P<layers>\d+)layers?)-k(?P<dk>\d+))$"
)


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    runner: str  # "engine" or "mlx-lm"
    kind: str  # "plain", "lookup" or "draft"
    k: int | None = None  # guesses per pass
    draft_layers: int | None = None  # None: the target itself (self)

    def describe(self, target_layers: int) -> dict[str, Any]:
        layers = (self.draft_layers or target_layers) if self.kind == "draft" else None
        return {"runner": self.runner, "kind": self.kind, "num_draft_tokens": self.k,
                "draft_layers": layers, "draft_is_target": layers == target_layers}  # fmt: skip


def parse_mode(name: str) -> Mode:
    m = MODE_PATTERN.match(name)
    if m is None:
        raise ValueError(f"unknown mode {name!r}: use plain, lookup-kN, draft-Mlayer-kN, "
                         "draft-self-kN, or one of plain / draft-... after mlx-lm-")  # fmt: skip
    runner = "mlx-lm" if m["mlx"] else "engine"
    if m["plain"]:
        return Mode(name, runner, "plain")
    if m["lk"] is not None and runner == "mlx-lm":
        raise ValueError(f"{name}: mlx-lm's stream_generate has no prompt lookup")
    k, layers = int(m["lk"] or m["dk"]), None if m["lk"] or m["self"] else int(m["layers"])
    if k < 1 or layers == 0:
        raise ValueError(f"{name}: the numbers in a mode must be >= 1")
    return Mode(name, runner, "lookup" if m["lk"] else "draft", k, layers)


def draft_checkpoint(ckpt: Checkpoint, layers: int | None) -> Checkpoint:
    """The target's first `layers` layers (None: all) on the very same weight arrays."""
    n = layers or ckpt.config.num_hidden_layers
    raw = {**ckpt.config.raw, "num_hidden_layers": n}
    config = dataclasses.replace(ckpt.config, num_hidden_layers=n, raw=raw)
    return Checkpoint(ckpt.path, config, ckpt.weights, ckpt.tokenizer)


def engine_server(spec: dict[str, Any], mode: Mode, ckpt: Checkpoint, draft: Checkpoint | None):
    """serve(prompts, batch_size, max_tokens) -> a row: serve_engine on the solution's Engine with
    a new proposer of the mode's (a new one for each call)."""
    api = load_solution(spec["solution"])
    target = api.Qwen3Model(ckpt, max_seq_len=spec["max_seq_len"])
    if draft is not None:  # a model of its own, on the same weight arrays
        draft = api.Qwen3Model(draft, max_seq_len=spec["max_seq_len"])

    def serve(prompts: list[list[int]], batch_size: int, max_tokens: int) -> dict[str, Any]:
        proposer = None
        if mode.kind == "lookup":
            proposer = api.PromptLookup(num_draft_tokens=mode.k, ngram=spec["ngram"])
        elif mode.kind == "draft":
            proposer = api.DraftModel(draft, target, num_draft_tokens=mode.k)
        kinds = []  # what the engine did in a step (on_step)
        engine = api.Engine(target, ckpt.tokenizer, max_seq_len=spec["max_seq_len"],
                            batch_size=batch_size, prefill_step=spec["prefill_step"], pools=None,
                            policy="hybrid", speculative=proposer,
                            on_step=lambda step: kinds.append(step.kind))  # fmt: skip
        params = api.SamplingParams(max_tokens=max_tokens)
        return serve_engine(engine, params, prompts, kinds)

    return serve


def serve_engine(engine, params, prompts: list[list[int]], kinds: list[str]) -> dict[str, Any]:
    """Every prompt at once through the engine, greedy, each step timed: a row. Decode: the steps
    that held no prompt chunk (kinds: what the engine did in the step; the engine's DraftModel
    fills its cache with the prompt in a request's first decode pass: for draft-* that counts as
    decode here)."""
    index = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    outputs = [{"token_ids": [], "text": "", "finish_reason": None} for _ in prompts]
    decode, passes, t0 = Counter(tokens=0, s=0.0, passes=0, rows=0), 0, time.perf_counter()
    while engine.has_work:
        kinds.clear()
        before, t = engine.scheduler.passes, time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        ran = engine.scheduler.passes - before  # the target's passes
        passes += ran
        for out in outs:
            record = outputs[index[out.request_id]]
            record["token_ids"] += out.token_ids
            record["text"] += out.text
            record["finish_reason"] = out.finish_reason or record["finish_reason"]
        tokens = sum(len(out.token_ids) for out in outs)
        if "prefill" not in kinds and tokens:  # (Counter.update adds)
            decode.update(
                tokens=tokens, s=dt, passes=ran, rows=sum(bool(o.token_ids) for o in outs)
            )
    wall = time.perf_counter() - t0
    if any(o["finish_reason"] is None for o in outputs):
        raise trace_run.WrongOutput("a request never finished")
    stats = engine.stats()
    counts = {"passes": passes, "proposed": stats["tokens_proposed"],
              "accepted": stats["tokens_accepted"]}  # fmt: skip
    return row_metrics(outputs, prompts, wall, decode, counts)


def serve_mlx_lm(model, draft, k: int | None, ckpt: Checkpoint, prompts, max_tokens: int) -> dict:
    """Every prompt in turn through mlx-lm's stream_generate (speculative with a draft), greedy,
    ending at EOS like the engine. A pass is a run of tokens marked from_draft ending with one
    that is not. Decode: from the first pass's end to the last token (mlx-lm prefills its draft
    before the first token, outside it)."""
    from mlx_lm.generate import stream_generate

    eos = ckpt.tokenizer.eos_token_ids
    wrapper = trace_run.mlx_lm_tokenizer(eos)
    kwargs = {} if draft is None else {"draft_model": draft, "num_draft_tokens": k}
    outputs, decode = [], Counter(tokens=0, s=0.0, passes=0, rows=0)
    counts, t0 = dict(passes=0, proposed=0, accepted=0), time.perf_counter()
    for prompt in prompts:
        ids, times, starts, closed = [], [], [], True  # starts: where each pass's tokens start
        for response in stream_generate(model, wrapper, prompt, max_tokens=max_tokens, **kwargs):
            starts += [len(ids)] if closed else []
            ids.append(response.token)
            times.append(time.perf_counter())
            closed = not response.from_draft
            counts["accepted"] += bool(response.from_draft)
        if draft is not None:  # each pass asked for min(k, tokens still allowed) guesses
            counts["proposed"] += sum(min(k, max_tokens - start) for start in starts)
        counts["passes"] += len(starts)
        if len(starts) > 1:  # the tokens after the first pass, over their time
            n = len(starts) - 1
            decode.update(
                tokens=len(ids) - starts[1], s=times[-1] - times[starts[1] - 1], passes=n, rows=n
            )
        text = ckpt.tokenizer.decode([t for t in ids if t not in eos])  # the model's tokenizer
        outputs.append({"token_ids": ids, "text": text, "finish_reason": response.finish_reason})
    return row_metrics(outputs, prompts, time.perf_counter() - t0, decode, counts)


def row_metrics(outputs, prompts, wall: float, decode: dict, counts: dict) -> dict[str, Any]:
    """One trace at one batch size: its numbers and its answers. acceptance: guesses kept /
    proposed (guesses past an EOS that ends an answer count as proposed, not kept)."""
    generated = sum(len(o["token_ids"]) for o in outputs)
    ratio = lambda a, b: a / b if b else None
    return {"requests": len(outputs), "prompt_tokens": sum(len(p) for p in prompts),
            "generated_tokens": generated, "wall_s": wall,
            "generated_tokens_per_s": generated / wall,
            "decode_tokens": decode["tokens"], "decode_s": decode["s"],
            "decode_tokens_per_s": ratio(decode["tokens"], decode["s"]),
            "decode_passes": decode["passes"], "decode_rows": decode["rows"],
            "tokens_per_pass": ratio(decode["tokens"], decode["passes"]),
            "tokens_per_row": ratio(decode["tokens"], decode["rows"]), **counts,
            "acceptance": ratio(counts["accepted"], counts["proposed"]),
            "outputs": [{**o, "prompt_tokens": len(p), "generated_tokens": len(o["token_ids"])}
                        for o, p in zip(outputs, prompts)]}  # fmt: skip

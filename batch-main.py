"""Continuous-batching demo: a batch of chat prompts through batch_generate, drawn live.

    pdm run batch-main [--model tiny|qwen3-0.6b|PATH] [--solution ref|tiny_llm] ...

The default model, `tiny`, is a synthetic checkpoint with random weights, made on first use
and needing no network: the scheduling is real, the text it writes is meaningless. Shortcut
names such as `qwen3-0.6b` are fetched by huggingface-hub into its cache. On a terminal the
decode slots and the prefill in progress are drawn with rich; otherwise one line is printed
per prefill chunk, per finished request and per `--log-every` decode steps. At the end come
the answers and the measurements (time to first token, decode tokens/s, longest decode gap).
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOLUTIONS = {"ref": "tiny_llm_ref", "tiny_llm": "tiny_llm"}
MIN_ANSWER_TOKENS = 8  # a prompt is only run when max_seq_len leaves at least this much room
FRAME_INTERVAL_S = 1 / 10  # the live view redraws at most this often
SUMMARY_TITLE = (
    "Per request (all arrive at t = 0): prompt tokens, prefill chunks, wait before its first "
    "chunk, time to first token, tokens generated, decode tokens/s, longest gap between two "
    "of its tokens, why it stopped (eos, or length: max-seq-len)"
)

# A paragraph about a made-up town; several prompts ask about it, so those prompts share a
# long common prefix and each of them needs several prefill chunks.
TOWN = (
    "Harrowfield is a small river town in a fictional northern valley, home to about nine "
    "thousand people. It grew up around a stone bridge built in 1742 by a ferryman named Odile "
    "Brask, who charged one copper coin per crossing until the town bought the bridge from her "
    "grandson. Today most people in Harrowfield work in the paper mill on the east bank or in "
    "the orchards that cover the southern hills, where the town's famous amber pears grow. "
    "Every October the town holds the Lantern Walk: families float paper lanterns made at the "
    "mill down the river at dusk, and the bakery on Tanner Street sells pear bread until "
    "midnight. The town council meets in the old customs house, and the library keeps a copy "
    "of every newspaper printed in the valley since 1810."
)


@dataclass(frozen=True)
class DemoPrompt:
    question: str
    context: str | None = None

    def content(self) -> str:
        return f"{self.context}\n\n{self.question}" if self.context else self.question

    def label(self) -> str:
        return f"[Harrowfield paragraph] {self.question}" if self.context else self.question


DEMO_PROMPTS = [
    DemoPrompt("Who built the bridge in Harrowfield, and when?", TOWN),
    DemoPrompt("What do most people in Harrowfield do for work?", TOWN),
    DemoPrompt("Describe the Lantern Walk in one sentence.", TOWN),
    DemoPrompt("Summarize the paragraph above in twelve words or fewer.", TOWN),
    DemoPrompt("Explain in two sentences what a KV cache is for."),
    DemoPrompt("Write a haiku about a train leaving a station at night."),
    DemoPrompt("What is 17 times 23? Show the steps."),
    DemoPrompt("Name three uses for a paper clip other than holding paper."),
    DemoPrompt("Translate 'good morning, friend' into French and Spanish."),
    DemoPrompt("Why is the sky blue? Answer in one short paragraph."),
]


class UsageError(Exception):
    """Bad input from the user: printed without a traceback, exit status 2."""


# --- command line ------------------------------------------------------------------------


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="batch-main",
        description="Continuous batching with chunked prefill, drawn live.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (synthetic, offline), a shortcut such as qwen3-0.6b, a Hugging Face repo "
        "id (org/name) or a local checkpoint directory",
    )
    p.add_argument(
        "--solution",
        choices=sorted(SOLUTIONS),
        default="ref",
        help="ref runs tiny_llm_ref, tiny_llm runs your code",
    )
    p.add_argument("--batch-size", type=positive, default=5, help="decode slots")
    p.add_argument("--prefill-step", type=positive, default=128, help="tokens per prefill chunk")
    p.add_argument("--max-seq-len", type=positive, default=512, help="prompt + answer tokens")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weights and activations (default: float32 on cpu, bfloat16 on gpu)",
    )
    p.add_argument(
        "--enable-thinking", action="store_true", help="let Qwen3 think (<think>...</think>)"
    )
    p.add_argument("--seed", type=int, default=0, help="shuffles the prompts")
    p.add_argument(
        "--num-prompts",
        type=positive,
        default=len(DEMO_PROMPTS),
        help=f"how many of the {len(DEMO_PROMPTS)} demo prompts to run",
    )
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("TINY_LLM_CACHE"),
        help="where the tiny checkpoint is made (default: $TINY_LLM_CACHE or ~/.cache/tiny-llm); "
        "downloaded models live in the Hugging Face cache ($HF_HOME)",
    )
    p.add_argument(
        "--log-every",
        type=positive,
        default=16,
        help="without a terminal: print every Nth decode step",
    )
    p.add_argument("--plain", action="store_true", help="line output even on a terminal")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel ranks (mlx.launch)")
    p.add_argument("--hostfile", help="with --tp: an mlx.launch hostfile (several machines)")
    args = p.parse_args(argv)
    if args.max_seq_len <= MIN_ANSWER_TOKENS:
        p.error(f"--max-seq-len must be more than {MIN_ANSWER_TOKENS}")
    if args.num_prompts > len(DEMO_PROMPTS):
        p.error(f"--num-prompts is at most {len(DEMO_PROMPTS)}")
    return args


# --- text helpers ------------------------------------------------------------------------


# Control characters (a random model writes any byte, escape sequences included) print as
# U+FFFD; the live view also shows newlines and tabs on one line.
_CONTROLS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}
_ONE_LINE = {**_CONTROLS, ord("\n"): "\u21b5", ord("\t"): " "}


def clean(text: str, keep_newlines: bool = True) -> str:
    """Generated text made safe to print."""
    return text.translate(_CONTROLS if keep_newlines else _ONE_LINE)


def answer_text(text: str, tokenizer: Any) -> str:
    """The detokenized answer without the end-of-sequence token it stopped on."""
    stops = [tokenizer.eos_token, "<|endoftext|>", "<|im_end|>"]
    changed = True
    while changed:
        changed = False
        for stop in stops:
            if stop and text.endswith(stop):
                text, changed = text[: -len(stop)], True
    return text.strip()


def tail(text: str, width: int) -> str:
    """The last `width` characters on one line."""
    if len(text) > width:
        text = "\u2026" + text[-(width - 1) :]
    return clean(text, keep_newlines=False)


# --- measurements ------------------------------------------------------------------------


@dataclass
class RequestStats:
    idx: int
    prompt_tokens: int
    num_chunks: int
    admitted: float  # model clock when its first chunk started
    chunks_done: int = 0
    prefilled: int = 0
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    generated: int = 0
    stop: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def decode_rate(self) -> float | None:
        """Tokens per second after the first token (which the last prefill chunk produces)."""
        if self.finished is None or self.generated < 2 or self.finished <= self.token_times[0]:
            return None
        return (self.generated - 1) / (self.finished - self.token_times[0])

    def longest_gap(self) -> tuple[float, float, float]:
        """(gap, start, end) of the longest wait between two consecutive tokens."""
        best = (0.0, 0.0, 0.0)
        for a, b in zip(self.token_times, self.token_times[1:]):
            if b - a > best[0]:
                best = (b - a, a, b)
        return best


class Recorder:
    """Timestamps every BatchStep with time.perf_counter().

    The model clock excludes the time spent inside the view, so drawing the screen does not
    show up as model time: a step's duration is measured from the end of the previous step.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.view_time = 0.0
        self.mark = 0.0  # model clock at the end of the last prefill chunk or decode step
        self.requests: dict[int, RequestStats] = {}
        self.prefill_time = 0.0
        self.prefill_tokens = 0
        self.prefill_ends: list[float] = []
        self.decode_time = 0.0
        self.decode_steps = 0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.view_time

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def record(self, step: Any, t: float) -> RequestStats | None:
        request = step.request
        if step.kind == "prefill":
            stats = self.requests.get(request.prompt_idx)
            if stats is None:
                stats = RequestStats(
                    request.prompt_idx,
                    len(request.prompt_tokens),
                    request.num_prefill_chunks,
                    admitted=self.mark,
                )
                self.requests[request.prompt_idx] = stats
            self.prefill_time += t - self.mark
            self.prefill_tokens += request.offset - stats.prefilled
            self.prefill_ends.append(t)
            stats.prefilled = request.offset
            stats.chunks_done += 1
            if request.is_prefill_done:
                stats.token_times = [t]
            self.mark = t
            return stats
        if step.kind == "decode":
            self.decode_time += t - self.mark
            self.decode_steps += 1
            for r in step.slots:
                if r is not None:
                    self.requests[r.prompt_idx].token_times.append(t)
            self.mark = t
            return None
        if step.kind == "finish":
            stats = self.requests[request.prompt_idx]
            if len(stats.token_times) < len(request.generated):
                stats.token_times.append(t)  # its last token, from the decode step under way
            stats.finished = t
            stats.generated = len(request.generated)
            last = request.generated[-1] if request.generated else None
            stats.stop = "eos" if last in request.eos_token_ids else "length"  # hit max_seq_len
            return stats
        return None  # admit, wait, preempt, refuse: nothing to time

    def longest_gap(self) -> tuple[float, int | None, int]:
        """(seconds, request, prefill chunks that ran inside the gap)."""
        gap, who, start, end = 0.0, None, 0.0, 0.0
        for stats in self.requests.values():
            g, a, b = stats.longest_gap()
            if g > gap:
                gap, who, start, end = g, stats.idx, a, b
        chunks = sum(1 for t in self.prefill_ends if start < t < end)
        return gap, who, chunks

    def decoded_tokens(self, slots: list[Any] = ()) -> int:
        """Tokens made by decode steps: finished requests, plus those still in `slots`."""
        done = sum(max(0, s.generated - 1) for s in self.requests.values())
        return done + sum(len(r.generated) - 1 for r in slots if r is not None)


# --- views -------------------------------------------------------------------------------


class PlainView:
    """One line per prefill chunk, per finished request and per `every` decode steps."""

    def __init__(self, every: int) -> None:
        self.every = every

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def show(self, step: Any, t: float, rec: Recorder, stats: RequestStats | None) -> None:
        r = step.request
        if step.kind == "prefill":
            line = (
                f"{t:8.3f}s prefill req {r.prompt_idx:>2}  chunk {stats.chunks_done} of "
                f"{r.num_prefill_chunks}  tokens {r.offset}/{len(r.prompt_tokens)}"
            )
            if r.is_prefill_done:
                line += "  -> first token"
            print(line, flush=True)
        elif step.kind == "finish":
            print(
                f"{t:8.3f}s finish  req {r.prompt_idx:>2}  {len(r.generated)} tokens "
                f"({stats.stop})",
                flush=True,
            )
        elif rec.decode_steps % self.every == 0 and any(step.slots):
            active = [(r.prompt_idx, r.offset) for r in step.slots if r is not None]
            where = " ".join(f"{i}@{pos}" for i, pos in active)
            print(
                f"{t:8.3f}s decode  step {rec.decode_steps:>4}  {len(active)} active  "
                f"[req@position] {where}",
                flush=True,
            )


class LiveView:
    """A rich.live.Live screen: header, the prefill in progress, the decode slots."""

    def __init__(self, console: Any, title: str, total: int, batch_size: int) -> None:
        from rich.live import Live

        self.console = console
        self.title = title
        self.total = total
        self.batch_size = batch_size
        self.slots: list[Any] = [None] * batch_size
        self.prefill: Any = None
        self.prefill_stats: RequestStats | None = None
        self.finished: deque[str] = deque(maxlen=4)
        self.done = 0
        self.last_draw = 0.0
        self.live = Live(console=console, auto_refresh=False, transient=True)

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)

    def show(self, step: Any, t: float, rec: Recorder, stats: RequestStats | None) -> None:
        self.slots = step.slots
        if step.kind == "prefill":
            self.prefill, self.prefill_stats = step.request, stats
        elif step.kind == "finish":
            self.done += 1
            self.finished.append(
                f"request {stats.idx} finished: {stats.generated} tokens ({stats.stop}), "
                f"first token after {stats.ttft:.2f} s"
            )
        now = time.perf_counter()
        if now - self.last_draw >= FRAME_INTERVAL_S or self.done == self.total:
            self.live.update(self.render(t, rec), refresh=True)
            self.last_draw = time.perf_counter()

    def render(self, t: float, rec: Recorder) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        rate = rec.decoded_tokens(self.slots) / rec.decode_time if rec.decode_time else 0.0
        header = Text.assemble(
            (self.title, "bold"),
            f"\n{t:.1f} s   decode steps {rec.decode_steps}   "
            f"waiting {self.total - len(rec.requests)}   finished {self.done}/{self.total}   "
            f"decode {rate:.1f} tokens/s",
        )
        prefill = Table.grid(padding=(0, 1))
        r = self.prefill
        if r is None:
            prefill.add_row(Text("prefill: waiting for the first request", style="dim"))
        else:
            stats = self.prefill_stats
            chunks = stats.chunks_done if stats else 0
            done = stats.prefilled if stats else 0  # r.offset keeps growing once it decodes
            state = "done, now decoding" if r.is_prefill_done else "in progress"
            prefill.add_row(
                Text(f"prefill request {r.prompt_idx}", style="bold cyan"),
                Text(f"chunk {chunks} of {r.num_prefill_chunks}"),
                ProgressBar(total=len(r.prompt_tokens), completed=done, width=30),
                Text(f"{done}/{len(r.prompt_tokens)} tokens, {state}"),
            )
        slots = Table(box=None, pad_edge=False, expand=False, header_style="bold")
        slots.add_column("slot", justify="right")
        slots.add_column("request", justify="right")
        slots.add_column("position", justify="right")
        slots.add_column("tokens", justify="right")
        slots.add_column("text (tail)", no_wrap=True)
        width = max(20, self.console.width - 40)
        for i, req in enumerate(self.slots):
            if req is None:
                slots.add_row(str(i), "-", "-", "-", Text("free", style="dim"))
            else:
                slots.add_row(
                    str(i),
                    str(req.prompt_idx),
                    str(req.offset),
                    str(len(req.generated)),
                    Text(tail(req.text(), width), style="green"),
                )
        recent = Text("\n".join(self.finished), style="dim") if self.finished else Text("")
        return Group(header, Text(""), prefill, Text(""), slots, Text(""), recent)


# --- the run -----------------------------------------------------------------------------


@dataclass
class Prepared:
    prompts: list[DemoPrompt]
    texts: list[str]
    lengths: list[int]
    skipped: list[tuple[DemoPrompt, int]]


def prepare_prompts(tokenizer: Any, args: argparse.Namespace) -> Prepared:
    """Shuffle the demo prompts under --seed, apply the chat template, keep the first
    --num-prompts that leave room for an answer within --max-seq-len."""
    order = list(DEMO_PROMPTS)
    random.Random(args.seed).shuffle(order)
    chosen, texts, lengths, skipped = [], [], [], []
    for prompt in order:
        messages = [{"role": "user", "content": prompt.content()}]
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, enable_thinking=args.enable_thinking
        )
        n = len(tokenizer.encode(text))
        if n + MIN_ANSWER_TOKENS > args.max_seq_len:
            skipped.append((prompt, n))
            continue
        chosen.append(prompt)
        texts.append(text)
        lengths.append(n)
        if len(chosen) == args.num_prompts:
            break
    if not chosen:
        shortest = min(n for _, n in skipped)
        raise UsageError(
            f"no demo prompt fits in --max-seq-len {args.max_seq_len}: the shortest has "
            f"{shortest} tokens and needs {MIN_ANSWER_TOKENS} more for its answer"
        )
    return Prepared(chosen, texts, lengths, skipped)


def resolve(args: argparse.Namespace) -> Path:
    from tiny_llm_support import SHORTCUTS, resolve_model

    try:
        return resolve_model(args.model, cache_dir=args.cache_dir)
    except (ValueError, FileNotFoundError) as e:
        first = str(e) if isinstance(e, FileNotFoundError) else f"unknown model {args.model!r}"
        names = "\n".join(f"  {name:<12} {repo}" for name, repo in SHORTCUTS.items())
        raise UsageError(
            f"{first}\n\nModel names:\n  {'tiny':<12} synthetic checkpoint, made locally, works "
            f"offline (its text is meaningless)\n{names}\nor a Hugging Face repo id (org/name), "
            "or a directory with config.json, *.safetensors and tokenizer.json."
        ) from e


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tiny_llm_support import (
        OPENBLAS_HINT,
        ModelNotAvailableError,
        blas_info,
        choose_device,
        load_checkpoint,
    )
    from tiny_llm_support.launch import in_ranks, join_ranks, relaunch_as_ranks

    console = Console(highlight=False, markup=False)  # model text may contain [brackets]
    live = console.is_terminal and not args.plain
    out: Callable[[str], None] = console.print if live else (lambda s: print(s, flush=True))

    try:
        device = choose_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from e
    dtype = args.dtype or ("bfloat16" if device == "gpu" else "float32")
    try:
        path = resolve(args)
    except ModelNotAvailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.tp > 1 and not in_ranks():
        return relaunch_as_ranks(args.tp, args.hostfile)  # each rank runs this command again
    group = join_ranks(args.tp) if args.tp > 1 else None  # from here on only rank 0 prints
    package = importlib.import_module(SOLUTIONS[args.solution])

    try:
        ckpt = load_checkpoint(path, dtype=dtype)
    except (ValueError, OSError) as e:  # a missing, mis-shaped or pickle-only checkpoint
        print(f"error: cannot load {path}: {e}", file=sys.stderr)
        return 1
    tokenizer = ckpt.tokenizer
    if tokenizer is None:
        print(f"error: {path} has no tokenizer.json", file=sys.stderr)
        return 1
    tiny = args.model == "tiny"
    prepared = prepare_prompts(tokenizer, args)

    c = ckpt.config
    out(
        f"model: {args.model} ({path}): {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} query / {c.num_key_value_heads} KV heads"
    )
    if tiny:
        out(
            "note: 'tiny' is a synthetic checkpoint with random weights. The batching is real; "
            "the text it writes is meaningless. Try --model qwen3-0.6b for real answers."
        )
    out(
        f"solution: {package.__name__}   device: {device} {dtype}   batch size {args.batch_size}"
        f"   prefill step {args.prefill_step}   max seq len {args.max_seq_len}"
    )
    shared = sum(1 for p in prepared.prompts if p.context)
    out(
        f"{len(prepared.prompts)} prompts (seed {args.seed}), {shared} sharing the Harrowfield "
        f"paragraph; prompt tokens {min(prepared.lengths)}..{max(prepared.lengths)}"
    )
    for prompt, n in prepared.skipped:
        out(
            f"skipped ({n} tokens, does not fit --max-seq-len {args.max_seq_len}): {prompt.label()}"
        )
    if device == "cpu":
        blas = blas_info()["blas"]
        out(f"blas: {blas}")
        if sys.platform.startswith("linux") and blas.startswith("reference"):
            out(f"hint: {OPENBLAS_HINT}")
        if dtype != "float32":
            out(f"hint: {dtype} matmul is slow on the CPU; --dtype float32 is faster")

    title = f"batch-main: {args.model} on {package.__name__}, {device} {dtype}"
    if live:
        view: Any = LiveView(console, title, len(prepared.prompts), args.batch_size)
    else:
        view = PlainView(args.log_every)

    try:
        model = package.Qwen3Model(ckpt, max_seq_len=args.max_seq_len)
        if group is not None:
            model.shard(group)
            out(f"tensor parallel: {group.size()} ranks, each with 1/{group.size()} of every block")
        rec = Recorder()  # the clock starts when the requests arrive, after the model is built

        def on_step(step: Any) -> None:
            t = rec.now()
            stats = rec.record(step, t)
            v0 = time.perf_counter()
            view.show(step, t, rec, stats)
            rec.view_time += time.perf_counter() - v0

        with view:
            results = package.batch_generate(
                model,
                tokenizer,
                prepared.texts,
                max_seq_len=args.max_seq_len,
                batch_size=args.batch_size,
                prefill_step=args.prefill_step,
                on_step=on_step,
            )
    except NotImplementedError as e:
        print(
            f"error: {package.__name__} is not finished yet: {e}\n"
            "Write that task (its chapter in the book explains it) and run again, "
            "or use --solution ref to watch the reference solution.",
            file=sys.stderr,
        )
        return 1
    wall = rec.wall()

    print_answers(out, prepared, dict(results), tokenizer, live, console)
    print_summary(out, rec, prepared, wall, live, console)
    if tiny:
        out("(tiny model: random weights, so the answers above are meaningless by design)")
    return 0


def print_answers(
    out: Callable[[str], None],
    prepared: Prepared,
    results: dict[int, str],
    tokenizer: Any,
    live: bool,
    console: Any,
) -> None:
    out("")
    for idx, prompt in enumerate(prepared.prompts):
        answer = clean(answer_text(results.get(idx, ""), tokenizer))
        if live:
            from rich.text import Text

            console.rule(f"request {idx}")
            console.print(Text.assemble(("prompt: ", "bold"), prompt.label()))
            console.print(Text.assemble(("answer: ", "bold green"), answer or "(empty)"))
        else:
            out(f"prompt {idx}: {prompt.label()}")
            lines = (answer or "(empty)").splitlines() or [""]
            out(f"answer {idx}: {lines[0]}")
            for line in lines[1:]:
                out(" " * len(f"answer {idx}: ") + line)


def print_summary(
    out: Callable[[str], None],
    rec: Recorder,
    prepared: Prepared,
    wall: float,
    live: bool,
    console: Any,
) -> None:
    headers = ["req", "prompt", "chunks", "wait s", "TTFT s", "tokens", "tok/s", "gap ms", "stop"]
    rows = []
    for idx in range(len(prepared.prompts)):
        s = rec.requests.get(idx)
        if s is None:
            continue
        rate = s.decode_rate()
        rows.append(
            [
                str(idx),
                str(s.prompt_tokens),
                str(s.num_chunks),
                f"{s.admitted:.3f}",
                f"{s.ttft:.3f}" if s.ttft is not None else "-",
                str(s.generated),
                f"{rate:.1f}" if rate is not None else "-",
                f"{s.longest_gap()[0] * 1000:.1f}",
                s.stop,
            ]
        )
    out("")
    if live:
        from rich import box
        from rich.table import Table

        table = Table(title=SUMMARY_TITLE, title_justify="left", box=box.SIMPLE_HEAD)
        for h in headers:
            table.add_column(h, justify="left" if h == "stop" else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    else:
        out(SUMMARY_TITLE)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        out("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for row in rows:
            out("  ".join(v.rjust(w) for v, w in zip(row, widths)))

    decoded = rec.decoded_tokens()
    ttfts = [s.ttft for s in rec.requests.values() if s.ttft is not None]
    gap, who, chunks = rec.longest_gap()
    prefill_rate = rec.prefill_tokens / rec.prefill_time if rec.prefill_time else 0.0
    decode_rate = decoded / rec.decode_time if rec.decode_time else 0.0
    out(
        f"prefill: {rec.prefill_tokens} tokens in {rec.prefill_time:.2f} s "
        f"({prefill_rate:.1f} tokens/s), {len(rec.prefill_ends)} chunks"
    )
    out(
        f"decode: {decoded} tokens in {rec.decode_steps} steps, {rec.decode_time:.2f} s "
        f"({decode_rate:.1f} tokens/s)"
    )
    if ttfts:
        out(
            f"time to first token: min {min(ttfts):.3f} s, mean {sum(ttfts) / len(ttfts):.3f} s, "
            f"max {max(ttfts):.3f} s"
        )
    if who is not None:
        out(
            f"longest decode gap: {gap * 1000:.1f} ms (request {who}; {chunks} prefill "
            f"chunk{'s' if chunks != 1 else ''} ran inside it)"
        )
    out(
        f"total: {wall:.2f} s wall, of which {rec.view_time:.2f} s drawing the view "
        "(the times above leave it out)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from tiny_llm_support import reexec_with_openblas

    reexec_with_openblas()
    sys.exit(main())

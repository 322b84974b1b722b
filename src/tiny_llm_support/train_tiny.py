"""Training the tiny chat model that `--model tiny` serves (`pdm run train-tiny`).

A Qwen3 of a few million parameters (mlx-lm's Qwen3 module as the trainable model) learns from
the committed corpus (tiny_corpus.py): the book's chapters as plain text and the Q&A pairs in
the chat template. Its tokenizer is the project's byte-level BPE with merges learned from the
same corpus. Everything is seeded, so the same corpus, settings and machine give the same
weights. The output directory gets the checkpoint in Hugging Face layout (16-bit weights); the
results directory (benches/results/ for the shipped checkpoint) the loss of every step
(train-tiny-log.csv), a summary the book quotes (train-tiny.json) and the loss curve
(train-tiny-loss.png).

mlx-lm is a development dependency: it is imported only when training runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import tokenizers

from .checkpoint import load_checkpoint
from .device import blas_info
from .models import TINY_CHAT_DIR
from .oracle import mlx_lm_qwen3
from .tiny import tiny_config, write_checkpoint
from .tiny_corpus import CORPUS_FILE, ROOT, build_corpus, file_sha256, read_corpus, write_corpus
from .tiny_tokenizer import byte_bpe_tokenizer_json, tiny_tokenizer_config
from .tokenizer import Tokenizer

RESULTS_DIR = ROOT / "benches" / "results"  # where the shipped checkpoint's run reports
LOG_FILE = "train-tiny-log.csv"
SUMMARY_FILE = "train-tiny.json"
PLOT_FILE = "train-tiny-loss.png"


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    num_merges: int = 1787  # 256 byte tokens + 1787 merges + 5 special tokens = 2048 ids
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    book_window: int = 256  # tokens of book text per training row
    book_share: float = 0.35  # fraction of the book's windows in each epoch (drawn at random)
    chat_repeats: int = 4  # copies of every Q&A pair per epoch
    answer_lead_tokens: int = 4  # the first tokens of an answer decide which answer it is...
    answer_lead_weight: float = 4.0  # ...so their loss counts this many times more
    epochs: int = 14
    batch_tokens: int = 2048  # rows of similar length are batched up to this many tokens
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    final_lr_fraction: float = 0.1  # cosine decay down to this fraction of learning_rate
    grad_clip: float = 1.0
    max_steps: int = 0  # stop early after this many steps (0: train every epoch)
    eval_pairs: int = -1  # Q&A pairs to answer greedily at the end (-1: all)


# A training row is one sequence: ids [n + 1] and the weights of its n targets (0 = no loss).
Row = tuple[np.ndarray, np.ndarray]
# A batch: inputs [B, L], targets [B, L], weights [B, L] (rows padded to the longest).
Batch = tuple[np.ndarray, np.ndarray, np.ndarray]


# --- tokenizer and rows ---------------------------------------------------------------------


def train_tokenizer(docs: list[dict[str, Any]], num_merges: int) -> tuple[str, Tokenizer]:
    """Merges learned from every distinct paragraph of the corpus (the Harrowfield paragraph,
    repeated before many questions, counts once)."""
    texts = []
    for doc in docs:
        texts += [doc["text"]] if doc["kind"] == "book" else [m["content"] for m in doc["messages"]]
    paragraphs = dict.fromkeys(p for text in texts for p in text.split("\n\n"))
    tokenizer_json = byte_bpe_tokenizer_json("\n\n".join(paragraphs), num_merges)
    hf = tokenizers.Tokenizer.from_str(tokenizer_json)
    return tokenizer_json, Tokenizer(hf, tiny_tokenizer_config())


def chat_row(
    tokenizer: Tokenizer, messages: list[dict[str, str]], lead_tokens: int, lead_weight: float
) -> Row:
    """The prompt exactly as the demo sends it (thinking off), then the answer and EOS.

    Only the answer and the empty think block before it carry loss: the model learns to
    answer, and to write the empty think block itself when a prompt leaves thinking on. The
    first `lead_tokens` of the answer weigh `lead_weight`: once they are right the rest of a
    memorized answer follows easily, and with equal weights they get too little of the loss.
    """
    user, answer = messages[:-1], messages[-1]["content"]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(user, enable_thinking=False))
    thinking = tokenizer.encode(tokenizer.apply_chat_template(user, enable_thinking=True))
    assert prompt[: len(thinking)] == thinking, "the think block must extend the prompt"
    reply = tokenizer.encode(answer) + [tokenizer.eos_token_id]
    ids = np.array(prompt + reply, dtype=np.int32)
    weights = np.zeros(len(ids) - 1, dtype=np.float32)
    weights[len(thinking) - 1 :] = 1.0  # targets from the first token after "assistant\n"
    weights[len(prompt) - 1 : len(prompt) - 1 + lead_tokens] = lead_weight
    return ids, weights


def book_tokens(tokenizer: Tokenizer, docs: list[dict[str, Any]]) -> np.ndarray:
    """Every book document, each followed by <|endoftext|>, as one stream of ids."""
    end = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for doc in docs:
        if doc["kind"] == "book":
            ids += tokenizer.encode(doc["text"]) + [end]
    return np.array(ids, dtype=np.int32)


def book_rows(stream: np.ndarray, window: int, start: int) -> list[Row]:
    """Windows of `window` targets from `start` on (a different start every epoch)."""
    rows = []
    for i in range(start, len(stream) - 1, window):
        ids = stream[i : i + window + 1]
        if len(ids) > 1:
            rows.append((ids, np.ones(len(ids) - 1, dtype=np.float32)))
    return rows


def make_batches(rows: list[Row], batch_tokens: int, rng: np.random.RandomState) -> list[Batch]:
    """Rows shuffled, then rows of similar length (the same multiple of 32 tokens) batched
    together, up to `batch_tokens` tokens a batch, each padded to its longest row."""
    buckets: defaultdict[int, list[Row]] = defaultdict(list)
    for i in rng.permutation(len(rows)):
        buckets[-(-(len(rows[i][0]) - 1) // 32)].append(rows[i])
    batches = []
    for size32, bucket in sorted(buckets.items()):
        size = max(1, batch_tokens // (size32 * 32))
        batches += [_pad(bucket[j : j + size]) for j in range(0, len(bucket), size)]
    return batches


def _pad(group: list[Row]) -> Batch:
    length = max(len(ids) - 1 for ids, _ in group)
    inputs = np.zeros((len(group), length), dtype=np.int32)
    targets = np.zeros((len(group), length), dtype=np.int32)
    weights = np.zeros((len(group), length), dtype=np.float32)
    for b, (ids, w) in enumerate(group):
        n = len(ids) - 1
        inputs[b, :n], targets[b, :n], weights[b, :n] = ids[:-1], ids[1:], w
    return inputs, targets, weights


def plan_batches(
    tokenizer: Tokenizer, docs: list[dict[str, Any]], s: TrainSettings
) -> list[tuple[int, str, Batch]]:
    """(epoch, "book" or "chat", batch) for every step of the run, deterministic under s.seed:
    every epoch has a random `book_share` of the book's windows and `chat_repeats` copies of
    every Q&A pair, in batches of one kind, in random order."""
    rng = np.random.RandomState(s.seed)
    stream = book_tokens(tokenizer, docs)
    chats = [
        chat_row(tokenizer, d["messages"], s.answer_lead_tokens, s.answer_lead_weight)
        for d in docs
        if d["kind"] == "chat"
    ]
    plan = []
    for epoch in range(1, s.epochs + 1):
        start = int(rng.randint(s.book_window)) if len(stream) > s.book_window else 0
        windows = book_rows(stream, s.book_window, start)
        keep = rng.permutation(len(windows))[: round(len(windows) * s.book_share)]
        book = make_batches([windows[i] for i in sorted(keep)], s.batch_tokens, rng)
        chat = make_batches(chats * s.chat_repeats, s.batch_tokens, rng)
        batches = [("book", b) for b in book] + [("chat", b) for b in chat]
        plan += [(epoch, *batches[i]) for i in rng.permutation(len(batches))]
    return plan[: s.max_steps] if s.max_steps else plan


# --- model and training ---------------------------------------------------------------------


def model_config(tokenizer_json: str, s: TrainSettings) -> dict[str, Any]:
    """config.json of the trained model (its weights are stored in float16)."""
    sizes = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
    ]
    overrides = {name: getattr(s, name) for name in sizes}
    return tiny_config(tokenizer_json, {**overrides, "torch_dtype": "float16"})


def weighted_loss(model: nn.Module, inputs: mx.array, targets: mx.array, weights: mx.array):
    """Mean cross-entropy over the targets that carry weight."""
    logits = model(inputs)  # [B, L, V]
    losses = nn.losses.cross_entropy(logits, targets, reduction="none")  # [B, L]
    return (losses * weights).sum() / weights.sum()


def learning_rate(s: TrainSettings, total_steps: int):
    warmup = min(s.warmup_steps, max(total_steps - 1, 0))
    decay = optim.cosine_decay(
        s.learning_rate, max(total_steps - warmup, 1), s.learning_rate * s.final_lr_fraction
    )
    if warmup == 0:
        return decay
    return optim.join_schedules(
        [optim.linear_schedule(s.learning_rate / warmup, s.learning_rate, warmup), decay],
        [warmup],
    )


def train(
    s: TrainSettings,
    out: Path,
    corpus: Path = CORPUS_FILE,
    results: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train from `corpus`, write the checkpoint into `out` and the log and summary into
    `results` (default: `out`)."""
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    corpus = Path(corpus)
    docs = read_corpus(corpus)
    tokenizer_json, tokenizer = train_tokenizer(docs, s.num_merges)
    config = model_config(tokenizer_json, s)
    plan = plan_batches(tokenizer, docs, s)
    if not plan:
        raise ValueError(f"{corpus}: no training rows")
    tokens = sum(int(weights.sum()) for _, _, (_, _, weights) in plan)
    log(f"corpus {corpus}: {len(docs)} documents; vocabulary {tokenizer.vocab_size}")
    log(f"{len(plan)} steps, {tokens} weighted target tokens, {blas_info()['blas']}")

    from mlx_lm.models import qwen3  # a development dependency

    mx.random.seed(s.seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict({**config, "model_type": "qwen3"}))
    optimizer = optim.AdamW(learning_rate(s, len(plan)), weight_decay=0.0)
    step_fn = nn.value_and_grad(model, weighted_loss)

    out, results = Path(out), Path(results or out)
    losses, rows = [], []  # the log is written once training ends: Ctrl-C leaves the old one
    for step, (epoch, kind, (inputs, targets, weights)) in enumerate(plan, start=1):
        lr = optimizer.learning_rate.item()
        loss, grads = step_fn(model, mx.array(inputs), mx.array(targets), mx.array(weights))
        grads, _ = optim.clip_grad_norm(grads, s.grad_clip)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        losses.append(loss.item())
        seconds = time.perf_counter() - t0
        loss_text, lr_text = f"{losses[-1]:.5f}", f"{lr:.3e}"
        rows.append([step, epoch, kind, loss_text, lr_text, inputs.size, f"{seconds:.1f}"])
        if step % 25 == 0 or step == len(plan):
            log(f"step {step}/{len(plan)}  loss {losses[-1]:.4f}  lr {lr:.2e}  {seconds:.0f} s")
    results.mkdir(parents=True, exist_ok=True)
    with open(results / LOG_FILE, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "epoch", "kind", "loss", "learning_rate", "tokens", "seconds"])
        writer.writerows(rows)
    train_seconds = time.perf_counter() - t0

    weights = {k: v.astype(mx.float16) for k, v in _flat_parameters(model).items()}
    write_checkpoint(out, config, weights, tokenizer_json)
    evaluation = evaluate(out, docs, s.eval_pairs)
    summary = {
        "final_loss": losses[-1],
        "last_epoch_mean_loss": _last_epoch_means(plan, losses),
        "steps": len(plan),
        "weighted_target_tokens": tokens,
        "parameters": int(sum(v.size for v in weights.values())),
        "corpus": {"file": corpus.name, "sha256": file_sha256(corpus), "documents": len(docs)},
        "weights_sha256": file_sha256(out / "model.safetensors"),
        "settings": asdict(s),
        "evaluation": evaluation,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "blas": blas_info()["blas"],
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "mlx": mx.__version__,
    }
    (results / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    log(f"final loss {losses[-1]:.4f}; {evaluation['exact']}/{evaluation['pairs']} answers exact")
    return summary


def _last_epoch_means(plan: list, losses: list[float]) -> dict[str, float]:
    """Mean loss of the last epoch's book batches and of its chat batches."""
    last = plan[-1][0]
    means = {}
    for kind in ("book", "chat"):
        mine = [loss for (epoch, k, _), loss in zip(plan, losses) if epoch == last and k == kind]
        if mine:
            means[kind] = round(float(np.mean(mine)), 5)
    return means


def _flat_parameters(model: nn.Module) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))


# --- evaluation -----------------------------------------------------------------------------


def greedy_reply(model: Any, tokenizer: Tokenizer, user: str, max_tokens: int = 160) -> list[int]:
    """Greedy answer of mlx-lm's model to one user message, up to and with EOS."""
    from mlx_lm.models.cache import make_prompt_cache

    text = tokenizer.apply_chat_template([{"role": "user", "content": user}])
    cache = make_prompt_cache(model)
    inputs, out = mx.array([tokenizer.encode(text)]), []
    while len(out) < max_tokens:
        token = mx.argmax(model(inputs, cache=cache)[0, -1]).item()
        out.append(token)
        if token in tokenizer.eos_token_ids:
            break
        inputs = mx.array([[token]])
    return out


def evaluate(path: Path, docs: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """How many Q&A answers the saved checkpoint (read back as float32) reproduces exactly."""
    ckpt = load_checkpoint(path, dtype="float32")
    model = mlx_lm_qwen3(ckpt)
    pairs = [d["messages"] for d in docs if d["kind"] == "chat"]
    pairs = pairs if limit < 0 else pairs[:limit]
    exact, missed = 0, []
    for messages in pairs:
        reply = greedy_reply(model, ckpt.tokenizer, messages[0]["content"])
        want = ckpt.tokenizer.encode(messages[1]["content"]) + [ckpt.tokenizer.eos_token_id]
        if reply == want:
            exact += 1
        else:
            missed.append(messages[0]["content"].split("\n\n")[-1])
    return {"pairs": len(pairs), "exact": exact, "missed": missed}


# --- the loss curve ---------------------------------------------------------------------------


def plot_losses(log_file: Path, png: Path) -> None:
    """The loss of every step, book and chat batches apart, with their means per epoch
    (matplotlib, a development dependency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log_file, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for kind, color, label in [
        ("book", "tab:blue", "book text"),
        ("chat", "tab:orange", "Q&A answers"),
    ]:
        mine = [r for r in rows if r["kind"] == kind]
        steps = [int(r["step"]) for r in mine]
        ax.plot(steps, [float(r["loss"]) for r in mine], ".", ms=2, color=color, alpha=0.35)
        per_epoch: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for r in mine:
            per_epoch[int(r["epoch"])].append((int(r["step"]), float(r["loss"])))
        ends = [max(x for x, _ in v) for _, v in sorted(per_epoch.items())]
        means = [float(np.mean([y for _, y in v])) for _, v in sorted(per_epoch.items())]
        ax.plot(ends, means, "o-", color=color, label=f"{label}: batches, mean per epoch")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per target token (nats)")
    ax.set_title("Training the tiny chat model")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train-tiny",
        description="Train the tiny chat model (the default of --model tiny).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=TINY_CHAT_DIR, help="checkpoint directory")
    p.add_argument(
        "--results",
        type=Path,
        help=f"log, summary and loss curve (default: {RESULTS_DIR} for the shipped checkpoint, "
        "else --out)",
    )
    p.add_argument("--corpus", type=Path, default=CORPUS_FILE, help="corpus (JSON lines)")
    p.add_argument(
        "--rebuild-corpus",
        action="store_true",
        help="first rebuild --corpus from book/src/*.md and data/tiny-chat/qa.txt",
    )
    p.add_argument("--seed", type=int, default=TrainSettings.seed)
    p.add_argument("--epochs", type=int, default=TrainSettings.epochs)
    p.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: all)")
    p.add_argument("--eval-pairs", type=int, default=-1, help="Q&A pairs to check (-1: all)")
    p.add_argument("--plot-only", action="store_true", help="only redraw the loss curve")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.max_steps < 0:
        p.error("--epochs must be >= 1 and --max-steps >= 0")
    if args.results is None:  # a trial run elsewhere keeps its results beside its checkpoint
        args.results = RESULTS_DIR if args.out == TINY_CHAT_DIR else args.out
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        plot_losses(args.results / LOG_FILE, args.results / PLOT_FILE)
        return 0
    if args.rebuild_corpus:
        sha = write_corpus(build_corpus(), args.corpus)
        print(f"rebuilt {args.corpus} (sha256 {sha})")
    settings = replace(
        TrainSettings(),
        seed=args.seed,
        epochs=args.epochs,
        max_steps=args.max_steps,
        eval_pairs=args.eval_pairs,
    )
    summary = train(settings, args.out, args.corpus, args.results)
    plot_losses(args.results / LOG_FILE, args.results / PLOT_FILE)
    print(f"wrote {args.out} in {summary['total_seconds']:.0f} s")
    print(f"weights sha256 {summary['weights_sha256']}")
    print(f"log, summary and loss curve: {args.results}/{{{LOG_FILE},{SUMMARY_FILE},{PLOT_FILE}}}")
    return 0

"""Training the tiny chat model that `--model tiny` serves (`pdm run train-tiny`).

A Qwen3 of a few million parameters (mlx-lm's Qwen3 module as the trainable model) learns from
the committed corpus (tiny_corpus.py): the book's chapters as plain text and the Q&A pairs in
the chat template. Its tokenizer is the project's byte-level BPE with merges learned from the
same corpus. Everything is seeded, so the same corpus, settings and machine give the same
weights. The output directory gets the checkpoint in Hugging Face layout (16-bit weights); the
results directory (benches/results/ for the shipped checkpoint) the loss of every step
(train-tiny-log.csv), a summary the book quotes (train-tiny.json) and the loss curve
(train-tiny-loss.png). The data and its batches are train_data's, the evaluation and the loss
curve train_eval's.

mlx-lm is a development dependency: it is imported only when training runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .device import blas_info
from .models import TINY_CHAT_DIR
from .tiny import tiny_config, write_checkpoint
from .tiny_corpus import CORPUS_FILE, ROOT, build_corpus, file_sha256, read_corpus, write_corpus
from .tokenizer import Tokenizer
from .train_data import Batch, book_rows, book_tokens, chat_row, make_batches, train_tokenizer
from .train_eval import evaluate, plot_losses

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


# --- the plan of a run ----------------------------------------------------------------------


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

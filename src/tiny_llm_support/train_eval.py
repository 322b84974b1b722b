"""How a run of train-tiny (train_tiny.py) is judged: how many Q&A answers the saved checkpoint
reproduces greedily (evaluate), and the loss curve drawn from the training log (plot_losses).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .checkpoint import load_checkpoint
from .oracle import mlx_lm_qwen3
from .tokenizer import Tokenizer


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

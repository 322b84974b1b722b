"""The training data of the tiny chat model (train_tiny.py): a byte-level BPE tokenizer learned
from the corpus, the corpus as training rows (each Q&A pair in the chat template, windows of the
book's text), and rows of similar length batched and padded.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import tokenizers

from .tiny_tokenizer import byte_bpe_tokenizer_json, tiny_tokenizer_config
from .tokenizer import Tokenizer

# A training row is one sequence: ids [n + 1] and the weights of its n targets (0 = no loss).
Row = tuple[np.ndarray, np.ndarray]
# A batch: inputs [B, L], targets [B, L], weights [B, L] (rows padded to the longest).
Batch = tuple[np.ndarray, np.ndarray, np.ndarray]


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

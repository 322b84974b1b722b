"""A small deterministic byte-level BPE tokenizer for the synthetic tiny checkpoints.

256 byte tokens, a few hundred merges learned from the built-in corpus below, and the
Qwen3 special tokens. Any UTF-8 text round-trips, because every byte has a token. The trained
tiny chat model (train_tiny.py) learns its own merges from its corpus with the same code.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
NUM_MERGES = 400

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

CORPUS = """
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and
predicts the next one. It turns each token into a vector, mixes the vectors with attention,
and then picks a word from the vocabulary. When the model writes a story, it writes one token
at a time, and every new token depends on all the tokens that came before it.

Once upon a time there was a little cat who lived in a small house near the river. Every
morning the cat walked to the market with her friend, a very old dog. They bought bread,
apples, cheese and a bottle of milk. In the afternoon they sat in the garden and watched the
birds. The weather was warm and the sky was blue, so they stayed outside until the evening.

How are you today? I am fine, thank you. What would you like to do this weekend? We could go
to the park, read a book, or cook a nice dinner together. Please remember to water the plants
and to close the window before you leave the house.

The attention layer compares every query with every key, turns the scores into weights with a
softmax, and returns a weighted sum of the values. A cache keeps the keys and values of earlier
positions, so the next step only computes the new row. Batching serves many requests at the
same time, and a scheduler decides which request runs in each step of the server.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 1))

Numbers and dates: 1, 2, 3, 10, 42, 100, 2024, 3.14, 0.5. Monday, Tuesday, Wednesday,
Thursday, Friday, Saturday and Sunday. January, February, March, April, May and June.
Questions, answers, examples, sentences, words, letters and characters are all part of text.
The teacher said that the students should write their answers in the notebook, and then
explain why the answer is correct. This is the end of the small training text.
"""


def _byte_symbols() -> list[str]:
    """The GPT-2 byte-to-character table, in byte order: printable bytes stand for themselves."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair)."""
    pieces = [p for p, _ in _pre_tokenizer().pre_tokenize_str(text)]
    word_counts = Counter(pieces)
    words = [list(w) for w in sorted(word_counts)]
    freqs = [word_counts["".join(w)] for w in words]
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)

    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges and pair_counts:
        best_count = max(pair_counts.values())
        best = min(p for p, c in pair_counts.items() if c == best_count)
        merges.append(best)
        for i in sorted(where.pop(best, ())):
            _replace_pair(words, i, best, freqs[i], pair_counts, where)
    return merges


def _replace_pair(words, i, pair, freq, pair_counts, where) -> None:
    """Merge `pair` inside word i, keeping the pair counts and index up to date."""
    old = words[i]
    for p in zip(old, old[1:]):
        pair_counts[p] -= freq
        if pair_counts[p] <= 0:
            del pair_counts[p]
    new, j = [], 0
    while j < len(old):
        if j + 1 < len(old) and (old[j], old[j + 1]) == pair:
            new.append(old[j] + old[j + 1])
            j += 2
        else:
            new.append(old[j])
            j += 1
    words[i] = new
    for p in zip(new, new[1:]):
        pair_counts[p] += freq
        where[p].add(i)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """The tokenizer.json text of the tiny tokenizer (deterministic, cached)."""
    return byte_bpe_tokenizer_json(CORPUS, NUM_MERGES)


def byte_bpe_tokenizer_json(text: str, num_merges: int) -> str:
    """tokenizer.json text of a byte-level BPE with `num_merges` merges learned from `text`,
    plus the Qwen3 special tokens (deterministic)."""
    merges = _learn_merges(text, num_merges)
    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tok.to_str(pretty=True)


def tiny_tokenizer_config() -> dict:
    """The tokenizer_config.json contents that go with `tiny_tokenizer_json()`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }

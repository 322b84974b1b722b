"""The training corpus of the tiny chat model: the book's chapters and a question-and-answer set.

The corpus is a JSON-lines file, one document per line, committed to the repository so that the
shipped checkpoint can be trained again after the book changes:

    {"kind": "book", "source": "book/src/week1-01-attention.md", "text": "# 1.1 Attention ..."}
    {"kind": "chat", "source": "data/tiny-chat/qa.txt", "messages": [{"role": "user", ...},
     {"role": "assistant", ...}]}

`build_corpus` makes it from book/src/*.md and data/tiny-chat/qa.txt (format described at the
top of that file); `read_corpus` reads it back.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository, when the package runs from src/
BOOK_DIR = ROOT / "book" / "src"
QA_FILE = ROOT / "data" / "tiny-chat" / "qa.txt"
CORPUS_FILE = ROOT / "data" / "tiny-chat" / "corpus.jsonl"


def parse_qa(text: str) -> list[tuple[str, str]]:
    """The (user message, answer) pairs of a Q&A file, in file order."""
    contexts: dict[str, str] = {}
    pairs: list[tuple[str, str]] = []
    for number, block in _blocks(text):
        head = block[0]
        if head.startswith("%"):  # "%name" and the paragraph on the lines after it
            contexts[head[1:].strip()] = " ".join(block[1:])
            continue
        context = None
        if head.startswith("@"):
            name = head[1:].strip()
            if name not in contexts:
                raise ValueError(f"Q&A block at line {number}: unknown context {name!r}")
            context, block = contexts[name], block[1:]
        questions = [line[3:].strip() for line in block if line.startswith("Q: ")]
        answer_at = next((i for i, line in enumerate(block) if line.startswith("A: ")), None)
        if not questions or answer_at is None or answer_at != len(questions):
            raise ValueError(f"Q&A block at line {number}: expected 'Q: ' lines, then 'A: '")
        answer = "\n".join([block[answer_at][3:].strip(), *block[answer_at + 1 :]])
        for question in questions:
            pairs.append((f"{context}\n\n{question}" if context else question, answer))
    return pairs


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """Blank-line separated blocks without comment lines, with their first line number."""
    blocks: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 0
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        line = line.rstrip()
        if line.startswith("#"):
            continue
        if line:
            start = start if current else number
            current.append(line)
        elif current:
            blocks.append((start, current))
            current = []
    return blocks


def build_corpus(book_dir: Path = BOOK_DIR, qa_file: Path = QA_FILE) -> list[dict[str, Any]]:
    """Book chapters (sorted by file name) then the Q&A pairs, as corpus documents."""
    chapters = sorted(Path(book_dir).glob("*.md"))
    if not chapters:
        raise FileNotFoundError(f"no book chapters (*.md) in {book_dir}")
    docs: list[dict[str, Any]] = []
    for chapter in chapters:
        text = chapter.read_text(encoding="utf-8").strip()
        docs.append({"kind": "book", "source": _relative(chapter), "text": text})
    for user, answer in parse_qa(Path(qa_file).read_text(encoding="utf-8")):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        docs.append({"kind": "chat", "source": _relative(Path(qa_file)), "messages": messages})
    return docs


def write_corpus(docs: list[dict[str, Any]], path: Path = CORPUS_FILE) -> str:
    """Write the corpus file; returns its sha256."""
    lines = [json.dumps(doc, ensure_ascii=False, sort_keys=True) for doc in docs]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return file_sha256(path)


def read_corpus(path: Path = CORPUS_FILE) -> list[dict[str, Any]]:
    """The documents of a corpus file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus not found: {path} (build it with `pdm run train-tiny --rebuild-corpus`)"
        )
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _relative(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)

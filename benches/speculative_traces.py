"""bench-speculative's two traces (benches/traces/speculative-*.json): chat prompts for the tiny
model, made from its own question-and-answer set by a fixed rule (trace_requests), written one
request a line (make_trace_file) and read back with their checks (read_trace); and the warm-up's
prompts, made the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benches import trace_run
from tiny_llm_support.tiny_corpus import QA_FILE, file_sha256, parse_qa

TRACE_SCHEMA = "tiny-llm/speculative-trace/v1"
TRACES_DIR = Path(__file__).resolve().parent / "traces"
TRACE_NAMES = ("grounded", "ungrounded")
DEFAULT_TRACES = {name: TRACES_DIR / f"speculative-{name}.json" for name in TRACE_NAMES}
# The SHA-256 of the committed trace files' bytes: a changed file is refused, so that results
# under one name always come from the same prompts. Regenerate them with --write-traces and
# update these lines together with them.
DEFAULT_TRACE_SHA256 = {
    "grounded": "48960c7450afb3d46f57f2ec189d033ab084c2a355c8e081482c66fc6520330e",
    "ungrounded": "0c718493909598a1979e2baf644ffdc89779ab08669963d0b5e6d7a395ab5957",
}
TRACE_MAX_TOKENS = 128  # every answer of the tiny model ends at EOS well before this
UNGROUNDED_EVERY = 3  # the ungrounded trace: every third context-free Q&A pair, in file order
WARMUP = (("Who built the bridge?", "harrowfield"), ("Write a haiku about a night train.", None))


def trace_requests(name: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """(contexts, requests) of a trace, from the Q&A set by a fixed rule: each distinct answer
    once, asked its first way. grounded: every pair with the Harrowfield paragraph; ungrounded:
    every UNGROUNDED_EVERY-th pair without a paragraph, in file order, from the first."""
    contexts, grounded, ungrounded, seen = {}, [], [], set()
    for user, answer in parse_qa(QA_FILE.read_text(encoding="utf-8")):
        context, _, question = user.rpartition("\n\n")
        if (bool(context), answer) in seen:
            continue
        seen.add((bool(context), answer))
        if context:
            contexts["harrowfield"] = context
        request = {"question": question, "context": "harrowfield" if context else None}
        (grounded if context else ungrounded).append({**request, "answer": answer})
    return (contexts, grounded) if name == "grounded" else ({}, ungrounded[::UNGROUNDED_EVERY])


def chat_prompt(tokenizer, contexts: dict[str, str], request: dict[str, Any]) -> list[int]:
    """The request's prompt ids: its one user message under the tokenizer's chat template."""
    question = request["question"]
    content = f"{contexts[request['context']]}\n\n{question}" if request["context"] else question
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


def warmup_prompts(tokenizer) -> list[list[int]]:
    """The warm-up's prompts (WARMUP: a grounded question and an ungrounded one), made like the
    traces' with `tokenizer`."""
    contexts = trace_requests("grounded")[0]
    return [chat_prompt(tokenizer, contexts, {"question": q, "context": c}) for q, c in WARMUP]


def make_trace_file(name: str, tokenizer) -> str:
    """A trace file's text: one line per request, so that a diff stays readable."""
    contexts, requests = trace_requests(name)
    for r in requests:
        r["prompt_ids"] = chat_prompt(tokenizer, contexts, r)
    rule = "every pair that has the Harrowfield paragraph before its question"
    if name == "ungrounded":
        rule = f"every {UNGROUNDED_EVERY}rd pair with no paragraph, in file order, from the first"
    generator = {"source": "data/tiny-chat/qa.txt", "source_sha256": file_sha256(QA_FILE),
                 "rule": f"each distinct answer once, asked its first way: {rule}",
                 "tokenizer": "tiny",
                 "command": "python benches/speculative.py --write-traces DIR"}  # fmt: skip
    about = (
        f"the {name} trace of bench-speculative: chat prompts for the tiny model, one user "
        "message each (a context paragraph, if any, then the question). prompt_ids: the tiny "
        "tokenizer's chat template (enable_thinking=False); answer: what qa.txt trains the model "
        "to say (for reading only; the benchmark compares against plain greedy)."
    )
    head = {"schema": TRACE_SCHEMA, "name": name, "about": about, "generator": generator,
            "max_tokens": TRACE_MAX_TOKENS, "contexts": contexts}  # fmt: skip
    rows = ",\n".join(f"    {json.dumps(r, ensure_ascii=True)}" for r in requests)
    return trace_run.trace_text(head, {"requests": f"[\n{rows}\n  ]"})


def read_trace(path: Path) -> tuple[dict[str, Any], str]:
    """A trace file's contents and the SHA-256 of its bytes."""
    return trace_run.read_trace_file(path, TRACE_SCHEMA, trace_problem)


def trace_problem(data: dict[str, Any]) -> str | None:
    """What a trace file's contents lack, or None."""
    requests, contexts = data.get("requests"), data.get("contexts")
    if not isinstance(requests, list) or not requests or not isinstance(contexts, dict):
        return "needs 'requests' (a non-empty list) and 'contexts'"
    for i, r in enumerate(requests):
        ok = isinstance(r, dict) and trace_run.is_token_ids(r.get("prompt_ids"))
        ok = ok and isinstance(r.get("question"), str) and r.get("context") in (None, *contexts)
        if not ok:
            return (
                f"request {i} needs a 'question', a 'context' (null or one of 'contexts') "
                "and 'prompt_ids' (token ids)"
            )
    return None

"""The batch-main demo's built-in chat prompts, and how a run picks and templates them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

MIN_ANSWER_TOKENS = 8  # a prompt is only run when max_seq_len leaves at least this much room

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


@dataclass
class PreparedPrompts:
    prompts: list[DemoPrompt]
    texts: list[str]  # after the chat template
    lengths: list[int]  # tokens
    skipped: list[tuple[DemoPrompt, int]]  # too long for max_seq_len, with their length


def prepare_prompts(
    tokenizer: Any, seed: int, num_prompts: int, max_seq_len: int, enable_thinking: bool = False
) -> PreparedPrompts:
    """Shuffle the demo prompts under `seed`, apply the chat template, keep the first
    `num_prompts` that leave room for an answer within `max_seq_len` (ValueError if none)."""
    order = list(DEMO_PROMPTS)
    random.Random(seed).shuffle(order)
    chosen = PreparedPrompts([], [], [], [])
    for prompt in order:
        messages = [{"role": "user", "content": prompt.content()}]
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        n = len(tokenizer.encode(text))
        if n + MIN_ANSWER_TOKENS > max_seq_len:
            chosen.skipped.append((prompt, n))
            continue
        chosen.prompts.append(prompt)
        chosen.texts.append(text)
        chosen.lengths.append(n)
        if len(chosen.prompts) == num_prompts:
            break
    if not chosen.prompts:
        shortest = min(n for _, n in chosen.skipped)
        raise ValueError(
            f"no demo prompt fits in --max-seq-len {max_seq_len}: the shortest has "
            f"{shortest} tokens and needs {MIN_ANSWER_TOKENS} more for its answer"
        )
    return chosen

"""Week 3: the batch job. batch_generate is handed every prompt up front and returns their
texts when the last one is done: a loop over the Engine of Week 4 Day 3 (engine.py), which runs
the Scheduler of Week 3 (scheduler.py) one iteration at a time. Add every prompt, step until
idle.
"""

from collections.abc import Callable

from tiny_llm_support import Tokenizer

from .engine import Engine, RequestRefused
from .paged_kv_cache import TinyKvPagedPool
from .qwen3 import Qwen3Model
from .sampler import SamplingParams
from .scheduler import BatchStep
from .shape_stable import Ladder
from .speculative import DraftModel, PromptLookup


def output_budgets(max_new_tokens: int | list[int | None] | None, n: int) -> list[int | None]:
    """One max_new_tokens per prompt, from None, one int for all, or a list with one each."""
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
    if len(budgets) != n:
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    for idx, budget in enumerate(budgets):
        if budget is not None and budget < 1:
            raise ValueError(f"max_new_tokens of prompt {idx} must be >= 1, got {budget}")
    return budgets


def batch_generate(
    model: Qwen3Model,
    tokenizer: Tokenizer,
    prompts: list[str | list[int]],
    max_seq_len: int = 512,
    batch_size: int = 5,
    prefill_step: int = 128,
    pools: list[TinyKvPagedPool] | None = None,
    on_step: Callable[[BatchStep], None] | None = None,
    max_new_tokens: int | list[int | None] | None = None,
    ignore_eos: bool = False,
    query_padding: bool | Ladder | None = None,
    policy: str = "alternate",
    speculative: PromptLookup | DraftModel | None = None,
) -> list[tuple[int, str]]:
    """Greedy-decode every prompt with continuous batching; returns (prompt_idx, text) in order.

    prefill_step is the chunk budget (Request's prefill_max_step); under the hybrid policy it
    is the token budget of a whole forward pass, decode rows included. Prompts are text or
    token ids; max_new_tokens is one limit for all or one per prompt; query_padding as for
    Request. speculative is a proposer (Week 4 Day 5), whose guesses the hybrid policy checks
    as extra decode rows; the texts stay the same, and the proposer counts the guesses it
    made and the model kept (its proposed and accepted). Every prompt and limit is checked
    before any cache exists. A prompt that could never fit the pool is refused (an on_step
    "refuse" event) and has no result.
    """
    results: dict[int, str] = {}

    def record(step: BatchStep) -> None:
        if step.kind == "finish":
            results[step.request.prompt_idx] = step.request.text()
        if on_step is not None:
            on_step(step)

    engine = Engine(
        model, tokenizer, max_seq_len, batch_size, prefill_step, pools, policy, query_padding,
        record, speculative,
    )  # fmt: skip
    budgets = output_budgets(max_new_tokens, len(prompts))
    tokens = [engine.check_prompt(prompt, idx) for idx, prompt in enumerate(prompts)]
    try:
        for ids, budget in zip(tokens, budgets):
            try:
                engine.add_request(ids, SamplingParams(max_tokens=budget, ignore_eos=ignore_eos))
            except RequestRefused:
                pass  # reported to on_step; the other prompts run
        while engine.has_work:
            engine.step()
    finally:
        engine.release()
    return sorted(results.items())

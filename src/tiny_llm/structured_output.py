"""Week 4 Day 8: structured output. A grammar decides which tokens may come next.

An agent framework asks for JSON that fits a schema; a model, the tiny one above all, cannot be
trusted to write it. So the engine does not ask: before each token is sampled, every token the
grammar does not allow at that point gets the logit -inf, and the sampler can only pick a
token that keeps the text a prefix of something the grammar accepts. When the grammar is
complete only EOS is left. The distribution among the allowed tokens is the model's own.

Which tokens are allowed is the hard part (a token is several characters, and a JSON schema is
a context-free grammar), and llguidance does it: its matcher follows one request's tokens
through the grammar and gives, at each step, a mask over the vocabulary (one bit a token). The
engine's part is what this module holds: each row of the batch with its own matcher, the mask
applied to that row only (a row without a grammar pays nothing), the matcher advanced with
every token the request accepts, and speculative decoding's guesses checked by the grammar
before the model checks them.
"""

import llguidance
import mlx.core as mx
import numpy as np

from tiny_llm_support import Tokenizer
from tiny_llm_support.tokenizer import grammar_tokenizer


class GrammarError(ValueError):
    """A grammar llguidance cannot compile, or a token it does not allow."""


class Grammar:
    """Where one request's text is in its grammar (an llguidance grammar, for example
    llguidance.LLMatcher.grammar_from_json_schema(schema)). vocab_size: the model's logits
    width, which may exceed the tokenizer's (padding rows no grammar allows)."""

    def __init__(self, tokenizer: Tokenizer, grammar: str, vocab_size: int):
        llg = grammar_tokenizer(tokenizer)  # llguidance's view of the tokenizer, built once
        self.matcher = llguidance.LLMatcher(llg, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.eos_token = llg.eos_token  # the EOS a complete grammar allows

    def allowed(self) -> mx.array:
        """[V] bool: the tokens that may come next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size]  # one bit a token
        return mx.array(np.pad(allowed, (0, self.vocab_size - allowed.size)).astype(bool))

    def advance(self, token: int) -> None:
        """The request accepted `token`: move the matcher past it."""
        raise NotImplementedError("Week 4 Day 8, Task 3: move the matcher past an accepted token")

    def guess_masks(self, guesses: list[int]) -> mx.array:
        """The masks [len(guesses) + 1, V] of a speculative pass's rows: row i's after the
        first i guesses. The matcher is where it was when this returns."""
        raise NotImplementedError(
            "Week 4 Day 8, Task 4: one mask per checked row, the matcher rolled back"
        )

    def valid_guesses(self, guesses: list[int]) -> int:
        """How many of the guesses, in order, the grammar allows: the rest would be rejected
        by the masked model anyway, so they need no rows. Nor does an EOS guess: nothing can
        follow it, and its row's own token is EOS whenever the guess would have been kept. (It
        is also the one guess guess_masks could not roll back: llguidance does not record an
        EOS taken after the grammar is complete, so rollback would undo one token too many.)"""
        n = self.matcher.validate_tokens(guesses)
        return guesses.index(self.eos_token) if self.eos_token in guesses[:n] else n


def mask_rows(logits: mx.array, masks: list[mx.array | None]) -> mx.array:
    """logits [N, V]; masks[i]: row i's allowed tokens [V] (bool), or None for a row without a
    grammar. Every token a row's grammar forbids gets -inf; other rows are left as they are."""
    raise NotImplementedError(
        "Week 4 Day 8, Task 2: forbid, in each constrained row, what its grammar forbids"
    )


def constrain(logits: mx.array, requests: list) -> mx.array:
    """logits [N, V], row i for requests[i] -> the rows of requests under a grammar masked."""
    masks = [None if r.grammar is None else r.grammar.allowed() for r in requests]
    return mask_rows(logits, masks)

"""Week 4 Day 8: the agents' server. Logprobs, and JSON that fits a schema.

Task 1  token_logprobs: the chosen token's log-probability (log-softmax of the raw logits, in
        float32 whatever their dtype) and the k most likely tokens of its row, most likely first.
Task 2  mask_rows: in each row under a grammar every token it forbids gets -inf; rows without
        one are left exactly as they are.
Task 3  Grammar.advance: the matcher moves past each token the request accepts; a token the
        grammar forbids is an error.
Task 4  Grammar.guess_masks: one mask per row a speculative pass checks (row i: after the first
        i guesses), and the matcher rolled back to where it was.
Task 5  TinyKvPagedCache.copy_on_write: a partly filled page another page table holds is copied
        to a page of the writer's own before it is written.
Task 6  fork_prefix: a fork's page tables start with its parent's pages (one more reference on
        each) holding every prompt token but the last, which the fork computes itself.

Oracles: a log-softmax in float64 numpy of the model's own logits, from one plain forward pass
of the whole sequence (no cache reuse, no batch); llguidance's matcher, walked by the test
itself; `jsonschema`, which validates every answer; the same request served alone, and the same
engine without speculation (token for token); the page pool's counters; n answers forked from
one prefill against the same n requests each prefilling its own prompt (token for token).
"""

import importlib
import json

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_all_pages_free

from tiny_llm_support import load_checkpoint
from tiny_llm_support.models import tiny_chat_dir

MAX_SEQ_LEN = 256
PAGE = 4
TOL = 1e-4  # the engine's logprobs against the oracle's (float32 model, float64 oracle)

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "bridge": {
                "type": "object",
                "properties": {
                    "builder": {"type": "string", "maxLength": 10},
                    "year": {"type": "integer", "minimum": 1700, "maximum": 1800},
                },
                "required": ["builder", "year"],
                "additionalProperties": False,
            }
        },
        "required": ["bridge"],
        "additionalProperties": False,
    },
    "array-enum": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["pear", "bridge", "mill"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    "bounded": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "int-list": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "maxItems": 4,
    },
}
QUESTIONS = [
    "Who built the bridge in Harrowfield, and when? Answer in JSON.",
    "What is a KV cache? Answer in JSON.",
    "Why is the sky blue? Answer in JSON.",
]


def grammar_of(schema) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )


GRAMMARS = {name: grammar_of(schema) for name, schema in SCHEMAS.items()}


def log_softmax64(logits) -> np.ndarray:
    """The oracle: log-softmax over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


# --- Task 1: token_logprobs -------------------------------------------------------------------


def diagnose(value: float, logits: np.ndarray, row: int, token: int) -> str:
    """What a wrong log-probability of `token` in `row` of logits [N, V] most likely is."""
    lp = log_softmax64(logits)
    if not np.isfinite(value):
        return (
            f"{value} for a token of log-probability {lp[row, token]:.2f}: the log of a softmax "
            "underflows for unlikely tokens, compute x - logsumexp(x)"
        )
    near = lambda x: np.isfinite(x) and abs(value - x) < 1e-3  # noqa: E731
    if near(logits[row, token]):
        return "it is the raw logit: subtract the row's logsumexp (a log-softmax)"
    if near(np.exp(lp[row, token])):
        return "it is a probability: the log-softmax, not the softmax"
    if logits.shape[0] > 1 and near(log_softmax64(logits.T).T[row, token]):
        return "normalized over the rows (axis 0): the log-softmax runs over the vocabulary"
    for other in range(logits.shape[0]):
        if other != row and near(lp[other, token]):
            return f"it is row {other}'s: each row scores its own token"
    for other in range(logits.shape[1]):
        if other != token and near(lp[row, other]):
            return f"it is token {other}'s value in that row: take the chosen token's"
    return "expected: the row's raw logits less their logsumexp (in float32), at the chosen token"


def check_rows(got, logits: np.ndarray, tokens: list[int], k: int, what: str, atol=2e-5):
    """got: token_logprobs' answer for logits [N, V] (float64 here, the oracle's input)."""
    lp = log_softmax64(logits)
    assert len(got) == len(tokens), f"{what}: {len(got)} TokenLogprobs for {len(tokens)} rows"
    for row, (entry, token) in enumerate(zip(got, tokens)):
        assert entry.token == token, f"{what}, row {row}: token {entry.token}, chosen {token}"
        assert isinstance(entry.logprob, float), (
            f"{what}, row {row}: logprob is a {type(entry.logprob).__name__}: give Python floats "
            "(.tolist() or .item()), which the server's JSON can hold"
        )
        assert abs(entry.logprob - lp[row, token]) < atol, (
            f"{what}, row {row}: log-probability {entry.logprob:.6f} of token {token}, the "
            f"float64 log-softmax says {lp[row, token]:.6f}: "
            f"{diagnose(entry.logprob, logits, row, token)}"
        )
        check_top(entry.top, lp[row], k, f"{what}, row {row}", atol)


def check_top(top, lp: np.ndarray, k: int, what: str, atol: float) -> None:
    """top: (id, log-probability) pairs against one row's oracle log-probabilities lp [V]. Ties
    may come in any order: the values must be the k largest, most likely first."""
    ids, values = [int(i) for i, _ in top], [v for _, v in top]
    want = np.sort(lp)[::-1][:k]
    assert len(ids) == k, f"{what}: {len(ids)} top entries for k={k}"
    assert len(set(ids)) == k, f"{what}: top ids {ids} repeat a token"
    for i, v in top:
        assert isinstance(v, float) and np.isclose(v, lp[i], rtol=0, atol=atol), (
            f"{what}: top entry ({i}, {v}), the oracle says token {i} has {lp[i]:.6f}: each top "
            "entry carries its own token's log-probability, from the same row"
        )
    if np.allclose(values, np.sort(lp)[:k], rtol=0, atol=atol) and k > 1:
        raise AssertionError(f"{what}: top {ids} are the least likely tokens: sort descending")
    if np.allclose(sorted(values, reverse=True), want, rtol=0, atol=atol) and k > 1:
        assert values == sorted(values, reverse=True), (
            f"{what}: top values {values}: the right tokens, but most likely first, please"
        )
    assert np.allclose(values, want, rtol=0, atol=atol), (
        f"{what}: top ids {ids} with values {np.round(values, 4).tolist()}, the row's {k} largest "
        f"log-probabilities are {np.round(want, 4).tolist()}: sort each row's own "
        "log-probabilities, descending, over the vocabulary axis"
    )


def test_token_logprobs_match_a_float64_log_softmax(impl):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(4, 50)).astype(np.float32)
    logits[3, 7] = logits[3].max() - 120  # probability e^-120: a float32 softmax says 0
    lp = log_softmax64(logits)
    # row 0 picks its most likely token, the others a token outside their top 5
    tokens = [int(lp[0].argmax()), int(lp[1].argmin()), int(np.argsort(-lp[2])[9]), 7]
    got = impl.token_logprobs(mx.array(logits), tokens, 5)
    check_rows(got, logits, tokens, 5, "four rows of float32 logits, k=5")
    one = impl.token_logprobs(mx.array(logits[2:3]), [3], 2)
    check_rows(one, logits[2:3], [3], 2, "one row, k=2")


def test_k_zero_gives_no_top_and_k_is_bounded(impl):
    logits = np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32)
    got = impl.token_logprobs(mx.array(logits), [0, 1, 2], 0)
    check_rows(got, logits, [0, 1, 2], 0, "k=0 (logprobs without top_logprobs)")
    twenty = impl.token_logprobs(mx.array(logits), [5, 6, 7], 20)
    check_rows(twenty, logits, [5, 6, 7], 20, "k=20, OpenAI's most")
    with pytest.raises(ValueError, match="k must be"):
        impl.token_logprobs(mx.array(logits), [0, 1, 2], 21)


def float16_case() -> tuple[np.ndarray, int, int]:
    """float16 logits [2, 32] and two tokens whose log-probabilities a float16 computation gets
    wrong: row 0's token 1 has probability ~e^-20 (below float16's smallest number: a softmax
    in float16 says 0, its log -inf), row 1's token is the one a float16 log-softmax rounds the
    most (float16 holds ~3 decimal digits)."""
    rng = np.random.default_rng(2)
    row0 = np.full(32, -9.0)
    row0[0] = 11.0
    row1 = rng.normal(0, 2, size=32)
    logits = np.stack([row0, row1]).astype(np.float16)
    in_half = np.array((lambda x: x - mx.logsumexp(x, axis=-1, keepdims=True))(mx.array(logits)))
    errors = np.abs(in_half[1].astype(np.float64) - log_softmax64(logits.astype(np.float64))[1])
    return logits, 1, int(errors.argmax())


def test_float16_logits_are_scored_in_float32(impl):
    logits, t0, t1 = float16_case()
    exact = log_softmax64(logits.astype(np.float64))
    x = mx.array(logits)
    in_half = np.array(x - mx.logsumexp(x, axis=-1, keepdims=True)).astype(np.float64)
    assert abs(in_half[1, t1] - exact[1, t1]) > 5e-4, "the case must catch float16 (test setup)"
    assert np.array(mx.softmax(x, axis=-1))[0, t0] == 0, "test setup: float16 says 0"
    got = impl.token_logprobs(x, [t0, t1], 3)
    for row, token, entry in ((0, t0, got[0]), (1, t1, got[1])):
        assert np.isfinite(entry.logprob), (
            f"float16 logits, row {row}: log-probability {entry.logprob} for a token of "
            f"probability ~{np.exp(exact[row, token]):.1e}: a softmax in float16 rounds it to 0. "
            "Cast the logits to float32 first, then take x - logsumexp(x)"
        )
        assert abs(entry.logprob - exact[row, token]) < 2e-5, (
            f"float16 logits, row {row}: {entry.logprob:.6f}, exactly {exact[row, token]:.6f}; "
            f"a log-softmax in float16 gives {in_half[row, token]:.6f}: cast the logits to "
            "float32 before the log-softmax (evaluators compare small differences)"
        )
    check_rows(got, logits.astype(np.float64), [t0, t1], 3, "float16 logits")


# --- Task 2: mask_rows ----------------------------------------------------------------------------


def test_mask_rows_forbids_only_what_each_rows_grammar_forbids(impl):
    rng = np.random.default_rng(3)
    V = 40
    for dtype in (mx.float32, mx.float16):
        logits = mx.array(rng.normal(size=(4, V)).astype(np.float32)).astype(dtype)
        allow0 = rng.random(V) < 0.3
        allow2 = rng.random(V) < 0.6
        allow3 = np.zeros(V, dtype=bool)
        allow3[[5, 17]] = True
        masks = [mx.array(allow0), None, mx.array(allow2), mx.array(allow3)]
        out = impl.mask_rows(logits, masks)
        name = "float32" if dtype == mx.float32 else "float16"
        assert out.shape == logits.shape, f"{name}: shape {out.shape}, logits {logits.shape}"
        assert out.dtype == logits.dtype, (
            f"{name} logits came back {out.dtype}: keep the logits' dtype (the sampler's and "
            "the logprobs' input)"
        )
        got, before = np.array(out.astype(mx.float32)), np.array(logits.astype(mx.float32))
        assert np.array_equal(got[1], before[1]), (
            f"{name}: row 1 has no grammar (mask None) and was changed: leave such rows exactly "
            "as they are"
        )
        for row, allow in ((0, allow0), (2, allow2), (3, allow3)):
            forbidden = got[row][~allow]
            assert np.all(np.isneginf(forbidden)), (
                f"{name}, row {row}: its grammar forbids {int((~allow).sum())} tokens, "
                f"{int((~np.isneginf(forbidden)).sum())} of them are not -inf"
                + (
                    " (a large negative number still leaves a token a chance, and in float16 "
                    "overflows): use -inf"
                    if np.all(forbidden < -1e3)
                    else ": each row takes its own mask (masks[i] for row i)"
                )
            )
            assert np.array_equal(got[row][allow], before[row][allow]), (
                f"{name}, row {row}: a token its grammar allows changed its logit: keep the "
                "allowed logits as they are (the distribution among them is the model's own)"
            )


def test_mask_rows_without_any_grammar_changes_nothing(impl):
    logits = mx.array(np.random.default_rng(4).normal(size=(3, 30)).astype(np.float32))
    out = impl.mask_rows(logits, [None, None, None])
    assert out.shape == logits.shape and np.array_equal(np.array(out), np.array(logits)), (
        "a batch without any grammar must come back unchanged"
    )
    one = impl.mask_rows(logits[:1], [mx.array(np.arange(30) < 3)])
    assert np.all(np.isneginf(np.array(one)[0, 3:])), "a batch of one constrained row"
    late = np.array(impl.mask_rows(logits[:2], [None, mx.array(np.arange(30) < 3)]))
    assert np.all(np.isneginf(late[1, 3:])) and np.array_equal(late[0], np.array(logits[0])), (
        "a batch whose first row has no grammar and whose second has one: the second row is "
        "masked all the same (a batch may skip the masking only when no row has a grammar)"
    )


# --- the grammar, step by step (Tasks 3 and 4) ----------------------------------------------------


@pytest.fixture(scope="module")
def chat(impl):
    """The trained tiny chat model in float32 (its logits compare to the oracle's at 1e-4), and
    its tokenizer."""
    ckpt = load_checkpoint(tiny_chat_dir(), dtype="float32")
    return impl.Qwen3Model(ckpt), ckpt.tokenizer


@pytest.fixture(scope="module")
def ll_tokenizer(chat):
    """llguidance's view of the chat tokenizer, for the test's own matchers."""
    tokenizer = chat[1]
    return llguidance.LLTokenizer(tokenizer.hf_tokenizer.to_str(), eos_token=tokenizer.eos_token_id)


class Walk:
    """The test's own llguidance matcher: the mask as the grammar stands, and consume."""

    def __init__(self, ll_tokenizer, grammar: str, vocab_size: int, tokens=()):
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        self.vocab_size = vocab_size
        for token in tokens:
            self.consume(token)

    def mask(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return np.pad(allowed, (0, self.vocab_size - allowed.size))

    def consume(self, token: int) -> None:
        assert self.matcher.consume_token(token), f"the oracle's matcher refused token {token}"


ANSWER = '{"name":"Odile Brask","age":42}'


def answer_tokens(tokenizer) -> list[int]:
    return tokenizer.encode(ANSWER)


def mask_of(grammar) -> np.ndarray:
    return np.array(grammar.allowed())


def allowed_text(tokenizer, mask: np.ndarray, most=6) -> str:
    return repr([tokenizer.decode([int(t)]) for t in np.flatnonzero(mask)[:most]])


def test_advance_follows_the_grammar_and_refuses_a_forbidden_token(impl, chat, ll_tokenizer):
    model, tokenizer = chat
    vocab = model.config.vocab_size
    grammar = impl.Grammar(tokenizer, GRAMMARS["bounded"], vocab)
    oracle = Walk(ll_tokenizer, GRAMMARS["bounded"], vocab)
    tokens = answer_tokens(tokenizer)
    for n, token in enumerate(tokens):
        before = mask_of(grammar)
        grammar.advance(token)
        oracle.consume(token)
        after, want = mask_of(grammar), oracle.mask()
        if not np.array_equal(after, want):
            stuck = np.array_equal(after, before)
            raise AssertionError(
                f"after advancing past {tokenizer.decode(tokens[: n + 1])!r} the grammar "
                f"allows {allowed_text(tokenizer, after)}..., llguidance's matcher "
                f"{allowed_text(tokenizer, want)}..."
                + (": the mask did not move, consume the token (matcher.consume_token)" * stuck)
            )
    assert np.flatnonzero(mask_of(grammar)).tolist() == [tokenizer.eos_token_id], (
        "the JSON is complete: only EOS may follow"
    )
    fresh = impl.Grammar(tokenizer, GRAMMARS["bounded"], vocab)
    forbidden = tokenizer.encode("x")[0]  # the answer must begin with '{'
    try:
        fresh.advance(forbidden)
    except impl.GrammarError:
        pass
    else:
        raise AssertionError(
            f"advance({forbidden}) ('x' where the grammar wants '{{') raised nothing: "
            "matcher.consume_token returns False for a token the grammar forbids; raise "
            "GrammarError then (a sampler that picked it had an unmasked row)"
        )


def test_guess_masks_are_each_rows_mask_and_the_matcher_rolls_back(impl, chat, ll_tokenizer):
    model, tokenizer = chat
    vocab = model.config.vocab_size
    tokens = answer_tokens(tokenizer)
    assert tokenizer.decode(tokens[-1:]) == "}", "the last guesses complete the JSON (test setup)"
    # guesses in the middle, then guesses that complete the grammar (the matcher stops there)
    for start, count in ((3, 4), (len(tokens) - 3, 3)):
        grammar = impl.Grammar(tokenizer, GRAMMARS["bounded"], vocab)
        for token in tokens[:start]:
            grammar.advance(token)
        guesses = tokens[start : start + count]
        oracle = Walk(ll_tokenizer, GRAMMARS["bounded"], vocab, tokens[:start])
        want = []
        for token in guesses:
            want.append(oracle.mask())
            oracle.consume(token)
        want.append(oracle.mask())
        masks = grammar.guess_masks(guesses)
        what = f"guess_masks({guesses}) after {tokenizer.decode(tokens[:start])!r}"
        assert masks.shape == (count + 1, vocab), (
            f"{what}: shape {masks.shape}, expected ({count + 1}, {vocab}): one row per row "
            "the pass checks, the last token's and one after each guess"
        )
        got = np.array(masks).astype(bool)
        for i in range(count + 1):
            if np.array_equal(got[i], want[i]):
                continue
            if i + 1 <= count and np.array_equal(got[i], want[i + 1]):
                hint = "row i is the mask before guess i is consumed: take it, then advance"
            elif np.array_equal(got[i], want[0]):
                hint = "every row is the same mask: advance past each guess after taking its row"
            else:
                hint = "row i is the mask after the first i guesses"
            raise AssertionError(f"{what}: row {i} differs from llguidance's: {hint}")
        start_mask = Walk(ll_tokenizer, GRAMMARS["bounded"], vocab, tokens[:start]).mask()
        assert np.array_equal(mask_of(grammar), start_mask), (
            f"{what}: afterwards the grammar allows {allowed_text(tokenizer, mask_of(grammar))}, "
            f"before it allowed {allowed_text(tokenizer, start_mask)}: roll the matcher back "
            "by the guesses it consumed (matcher.rollback), so that the tokens the pass keeps "
            "can be accepted"
        )
        for token in tokens[start:]:  # the guesses accepted for real, then the rest
            grammar.advance(token)
        assert np.flatnonzero(mask_of(grammar)).tolist() == [tokenizer.eos_token_id], (
            f"{what}, then the rest of the answer advanced: the grammar is not where a fresh "
            "matcher given the same tokens is"
        )
    grammar = impl.Grammar(tokenizer, GRAMMARS["bounded"], vocab)
    none = grammar.guess_masks([])
    assert none.shape == (1, vocab) and np.array_equal(np.array(none)[0], mask_of(grammar)), (
        "no guesses: one row, the mask as the grammar stands"
    )


# --- the engine: JSON that fits, logprobs that are the model's --------------------------------


def prompt_of(tokenizer, i: int) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % 3]}])
    return tokenizer.encode(text)


def engine_for(impl, model, tokenizer, pools=None, policy="alternate", **kwargs):
    settings = dict(max_seq_len=MAX_SEQ_LEN, batch_size=4, prefill_step=16, policy=policy)
    settings.update(kwargs)
    return impl.Engine(model, tokenizer, pools=pools, **settings)


def serve(engine, requests, on_step=None) -> dict:
    """Add every (prompt, params), step until idle; {index: (tokens, text, reason, logprobs)}
    with logprobs None when no output carried any. Checks each output's logprobs line up
    with its tokens."""
    ids = {engine.add_request(p, params): i for i, (p, params) in enumerate(requests)}
    got = {i: ([], "", None, None) for i in ids.values()}
    for _ in range(3000):
        if not engine.has_work:
            break
        for out in engine.step():
            i = ids[out.request_id]
            tokens, text, _, logprobs = got[i]
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.token_ids), (
                    f"request {i}: an output of {len(out.token_ids)} tokens carries "
                    f"{len(out.logprobs)} logprobs: one TokenLogprob per token"
                )
                logprobs = (logprobs or []) + list(out.logprobs)
            got[i] = (tokens + out.token_ids, text + out.text, out.finish_reason, logprobs)
        if on_step is not None:
            on_step(engine)
    assert not engine.has_work, "the engine did not go idle"
    return got


def params(impl, name=None, seed=None, **kwargs):
    """Greedy (seed None) or seeded sampling, under the grammar of schema `name` (or none)."""
    kwargs.setdefault("max_tokens", 100)
    if seed is not None:
        kwargs.update(temperature=1.0, seed=seed)
    return impl.SamplingParams(grammar=None if name is None else GRAMMARS[name], **kwargs)


def mixed_requests(impl, tokenizer):
    """Each schema greedy and sampled, beside free-text requests (greedy and sampled)."""
    out = []
    for n, name in enumerate(SCHEMAS):
        out.append((prompt_of(tokenizer, n), params(impl, name)))
        out.append((prompt_of(tokenizer, n + 1), params(impl, name, seed=10 + n)))
    out.append((prompt_of(tokenizer, 0), params(impl, max_tokens=30)))
    out.append((prompt_of(tokenizer, 2), params(impl, seed=5, max_tokens=30)))
    return out


@pytest.fixture(scope="module")
def alone(impl, chat):
    """What each request of mixed_requests generates served on its own."""
    model, tokenizer = chat
    return {
        i: serve(engine_for(impl, model, tokenizer, batch_size=1), [request])[0]
        for i, request in enumerate(mixed_requests(impl, tokenizer))
    }


def check_json(text: str, reason, name: str, what: str) -> None:
    assert reason == "stop", (
        f"{what}: schema {name!r} ended with {reason!r} after {text!r}: a complete answer "
        "under a grammar ends with EOS (the only token a complete grammar allows)"
    )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(
            f"{what}: schema {name!r}: {text!r} is not JSON ({e}): every row under a grammar "
            "must be masked before its token is picked, and each request's own mask applied "
            "to its own row"
        ) from None
    try:
        jsonschema.validate(value, SCHEMAS[name])
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{what}: {text!r} breaks schema {name!r}: {e.message}") from None


def name_of(request) -> str | None:
    grammar = request[1].grammar
    return next((n for n, g in GRAMMARS.items() if g == grammar), None)


@pytest.mark.parametrize(
    "policy, cache",
    [("alternate", "dense"), ("hybrid", "dense"), ("alternate", "paged"), ("hybrid", "small")],
)
def test_answers_fit_their_schema_and_free_rows_are_untouched(impl, chat, alone, policy, cache):
    """Constrained requests (greedy and seeded, four schemas) beside free-text ones in one
    batch: every constrained answer parses and validates; every request generates what it
    generates alone, the free-text ones above all (a mask applied to the wrong row shows)."""
    model, tokenizer = chat
    pools = None  # "small": 40 pages of 4 tokens for 4 slots of up to 34: preemptions
    if cache != "dense":
        pools = model.create_kv_pools(page_size=PAGE, max_pages=40 if cache == "small" else None)
    requests = mixed_requests(impl, tokenizer)
    events = []
    engine = engine_for(impl, model, tokenizer, pools, policy, on_step=events.append)
    got = serve(engine, requests)
    for i, request in enumerate(requests):
        name, (tokens, text, reason, _) = name_of(request), got[i]
        what = f"{policy}, {cache}: request {i} ({'greedy' if request[1].greedy else 'seeded'})"
        if name is not None:
            check_json(text, reason, name, what)
        assert tokens == alone[i][0], (
            f"{what}, "
            + ("free text" if name is None else f"schema {name!r}")
            + ", generated other tokens in the batch than alone: "
            + (
                "mask_rows changed a row without a grammar; leave it exactly as it is"
                if name is None
                else "each row takes its own request's mask"
            )
        )
    if pools is not None:
        assert_all_pages_free(pools, f"{policy}, {cache}: every request has ended")
    if cache == "small":
        assert any(e.kind == "preempt" for e in events), "the small pool must preempt (setup)"


def forward_logprobs(model, tokens: list[int]) -> np.ndarray:
    """The oracle: the log-softmax (float64) of every row of one plain forward pass."""
    logits = model(mx.array([tokens]), 0, model.create_kv_cache())[0]
    return log_softmax64(np.array(logits.astype(mx.float32)))


def check_logprobs(model, prompt, tokens, logprobs, k, what, masks=None, temperature=0.0):
    """Each generated token's TokenLogprob against the oracle; masks: the grammar's mask before
    each token (the distribution a constrained request is scored on)."""
    assert logprobs is not None and len(logprobs) == len(tokens), (
        f"{what}: {0 if logprobs is None else len(logprobs)} logprobs for {len(tokens)} tokens"
    )
    full = prompt + tokens[:-1]
    logits = model(mx.array([full]), 0, model.create_kv_cache())[0]
    logits = np.array(logits.astype(mx.float32)).astype(np.float64)[len(prompt) - 1 :]
    if masks is not None:
        logits = np.where(np.stack(masks), logits, -np.inf)
    lp = log_softmax64(logits)
    for n, (entry, token) in enumerate(zip(logprobs, tokens)):
        assert entry.token == token, f"{what}, token {n}: TokenLogprob.token {entry.token}"
        want = lp[n, token]
        if abs(entry.logprob - want) > TOL:
            hint = diagnose(entry.logprob, logits, n, token)
            if (
                temperature
                and abs(entry.logprob - log_softmax64(logits / temperature)[n, token]) < 1e-3
            ):
                hint = "scaled by the temperature: logprobs are of the raw logits"
            raise AssertionError(
                f"{what}, token {n} ({token}): logprob {entry.logprob:.6f}, the log-softmax of "
                f"a plain forward pass says {want:.6f}"
                + (" (after the grammar's mask)" if masks is not None else "")
                + f": {hint}"
            )
        check_top(entry.top, lp[n], k, f"{what}, token {n}", TOL)


def grammar_masks(ll_tokenizer, name, vocab, tokens) -> list[np.ndarray]:
    walk, masks = Walk(ll_tokenizer, GRAMMARS[name], vocab), []
    for token in tokens:
        masks.append(walk.mask())
        walk.consume(token)
    return masks


@pytest.mark.parametrize("how", ["alternate", "hybrid", "lookup", "draft"])
def test_logprobs_are_the_models_raw_distribution(impl, chat, ll_tokenizer, how):
    """Greedy, temperature-2 (with top-k) and top-p requests score their tokens on the model's
    raw distribution; a constrained one on its masked distribution. Against a log-softmax of
    one plain forward pass over each request's prompt and tokens."""
    model, tokenizer = chat
    speculative = {"lookup": impl.PromptLookup(3), "draft": impl.DraftModel(model, model, 2)}
    pools = model.create_kv_pools(page_size=PAGE)
    policy = "alternate" if how == "alternate" else "hybrid"
    engine = engine_for(impl, model, tokenizer, pools, policy, speculative=speculative.get(how))
    prompts = [prompt_of(tokenizer, i) for i in range(3)]
    short = dict(max_tokens=12, seed=1)
    requests = [
        (prompts[0], impl.SamplingParams(max_tokens=12, logprobs=3)),
        (prompts[1], impl.SamplingParams(logprobs=3, temperature=2.0, top_k=20, **short)),
        (prompts[2], impl.SamplingParams(logprobs=0, temperature=0.7, top_p=0.8, **short)),
        (prompts[0], impl.SamplingParams(max_tokens=12)),
        (prompts[1], params(impl, "bounded", logprobs=2)),
    ]
    got = serve(engine, requests)
    for i, k, temperature in ((0, 3, 0.0), (1, 3, 2.0), (2, 0, 0.7)):
        tokens, _, _, logprobs = got[i]
        what = f"{how}: request {i}"
        check_logprobs(model, requests[i][0], tokens, logprobs, k, what, temperature=temperature)
    assert got[3][3] is None, "a request that did not ask for logprobs gets None"
    tokens, text, _, logprobs = got[4]
    vocab = model.config.vocab_size
    masks = grammar_masks(ll_tokenizer, "bounded", vocab, tokens)
    what = f"{how}: a request under a grammar"
    check_logprobs(model, requests[4][0], tokens, logprobs, 2, what, masks=masks)
    assert_all_pages_free(pools, f"{how}: every request has ended")


def test_the_temperature_does_not_change_the_logprobs(impl, chat, monkeypatch):
    """The same tokens under temperature 0 and 2 score the same: a script sampler forces the
    temperature-2 request to generate the greedy request's tokens."""
    model, tokenizer = chat
    prompt = prompt_of(tokenizer, 0)
    cold = impl.SamplingParams(max_tokens=8, logprobs=2)
    greedy = serve(engine_for(impl, model, tokenizer), [(prompt, cold)])[0]
    sampler = module(impl, "sampler")
    script = iter(greedy[0])

    def scripted(self):
        return None if self.greedy else lambda logits: mx.array([next(script)])

    monkeypatch.setattr(sampler.SamplingParams, "sampler", scripted)
    warm = impl.SamplingParams(max_tokens=8, logprobs=2, temperature=2.0, seed=0)
    hot = serve(engine_for(impl, model, tokenizer), [(prompt, warm)])[0]
    assert hot[0] == greedy[0], "the script was not followed (test setup)"
    for n, (a, b) in enumerate(zip(greedy[3], hot[3])):
        same_top = [i for i, _ in a.top] == [i for i, _ in b.top]
        assert abs(a.logprob - b.logprob) < 1e-6 and same_top, (
            f"token {n}: logprob {b.logprob:.5f} at temperature 2, {a.logprob:.5f} at "
            "temperature 0 for the same token after the same tokens: logprobs are of the raw "
            "logits, before temperature, top-k and top-p"
        )


# --- speculative decoding under a grammar ---------------------------------------------------------


def module(impl, name="speculative"):
    return importlib.import_module(f"{impl.__name__}.{name}")


class Oracle:
    """A proposer that knows each request's plain answer. Every other pass it spoils its last
    guess with a token no grammar allows; near the end it guesses the closing tokens and EOS
    together (the grammar completes, and stops, inside the guesses)."""

    num_draft_tokens = 3

    def __init__(self, impl, answers, spoiler):
        self.draft_of, self.answers, self.spoiler = module(impl).Draft, answers, spoiler
        self.proposed = self.accepted = self.passes = 0
        self.with_eos = self.spoiled = 0

    def propose(self, request, most):
        answer = self.answers[tuple(request.prompt_tokens), request.params.grammar]
        tail = answer[len(request.generated) :]
        n = most - 1 if len(tail) == most + 1 else most  # so that a later pass guesses the end
        guess = list(tail[:n])
        self.passes += 1
        if len(tail) > most + 1 and len(guess) >= 2 and self.passes % 2:
            guess[-1] = self.spoiler
            self.spoiled += 1
        self.with_eos += request.grammar is not None and answer[-1] in guess  # answer[-1]: EOS
        return self.draft_of(guess)

    def rewind(self, request):
        pass

    def forget(self, live):
        pass


def constrained_requests(impl, tokenizer, seed=None):
    return [
        (prompt_of(tokenizer, n), params(impl, name, seed=None if seed is None else seed + n))
        for n, name in enumerate(SCHEMAS)
    ] + [(prompt_of(tokenizer, 1), params(impl, max_tokens=20))]


@pytest.fixture(scope="module")
def plain_constrained(impl, chat):
    model, tokenizer = chat
    requests = constrained_requests(impl, tokenizer)
    return serve(engine_for(impl, model, tokenizer, policy="hybrid"), requests)


@pytest.mark.parametrize(
    "proposer, policy",
    [("lookup", "hybrid"), ("lookup", "alternate"), ("draft", "hybrid"), ("oracle", "hybrid")],
)
def test_greedy_speculation_under_a_grammar_generates_the_plain_tokens(
    impl, chat, plain_constrained, monkeypatch, proposer, policy
):
    model, tokenizer = chat
    requests = constrained_requests(impl, tokenizer)
    (spoiler,) = tokenizer.encode("\n")  # a raw newline: no JSON grammar here allows one
    answers = {(tuple(p), q.grammar): plain_constrained[i][0] for i, (p, q) in enumerate(requests)}
    make = {
        "lookup": lambda: impl.PromptLookup(4),
        "draft": lambda: impl.DraftModel(model, model, 3),
        "oracle": lambda: Oracle(impl, answers, spoiler),
    }
    spec = module(impl)
    real_verify, checked = spec.verify, []

    def verify(request, logits):
        if request.grammar is not None:
            guesses = request.draft.tokens
            valid = request.grammar.matcher.validate_tokens(guesses)
            assert valid == len(guesses), (
                f"guesses {guesses} reached the check, the grammar allows only the first "
                f"{valid}: guesses it forbids must be dropped before the pass (grammatical)"
            )
            checked.append(len(guesses))
        return real_verify(request, logits)

    monkeypatch.setattr(spec, "verify", verify)
    pools = model.create_kv_pools(page_size=PAGE)
    chosen = make[proposer]()
    engine = engine_for(impl, model, tokenizer, pools, policy, speculative=chosen)
    try:
        got = serve(engine, requests)
    except impl.GrammarError as e:
        raise AssertionError(
            f"{proposer}, {policy}: a token a speculative pass kept broke the grammar: "
            "guess_masks must leave the matcher exactly where it was (roll back every guess "
            f"it consumed), so that the kept tokens can be accepted. {str(e)[:300]}"
        ) from None
    for i, request in enumerate(requests):
        name, (tokens, text, reason, _) = name_of(request), got[i]
        if name is not None:
            check_json(text, reason, name, f"{proposer}, {policy}: request {i}")
        assert tokens == plain_constrained[i][0], (
            f"{proposer}, {policy}: request {i} ({name or 'free text'}) generated other tokens "
            "with speculation than without: each checked row must be masked as the grammar "
            "stands after the guesses before it (guess_masks), and the matcher rolled back "
            "before the kept tokens are accepted"
        )
    assert_all_pages_free(pools, f"{proposer}, {policy}: every request has ended")
    assert any(checked), f"{proposer}: no guess was checked under a grammar (test setup)"
    if proposer == "oracle":
        assert chosen.with_eos and chosen.spoiled, "the oracle meant to guess EOS (test setup)"


def test_sampled_speculation_under_a_grammar_fits_the_schema(impl, chat):
    model, tokenizer = chat
    pools = model.create_kv_pools(page_size=PAGE)
    draft = impl.DraftModel(model, model, 3)
    engine = engine_for(impl, model, tokenizer, pools, "hybrid", speculative=draft)
    requests = constrained_requests(impl, tokenizer, seed=20)
    got = serve(engine, requests)
    for i, request in enumerate(requests):
        if name_of(request) is not None:
            check_json(got[i][1], got[i][2], name_of(request), f"sampled draft: request {i}")
    assert engine.stats()["tokens_accepted"] > 0, "the draft's guesses were never kept (setup)"
    assert_all_pages_free(pools, "sampled speculation has ended")


def test_an_aborted_constrained_request_frees_everything(impl, chat):
    model, tokenizer = chat
    pools = model.create_kv_pools(page_size=PAGE)
    engine = engine_for(impl, model, tokenizer, pools, "hybrid")
    victim = engine.add_request(prompt_of(tokenizer, 0), params(impl, "nested"))
    other = engine.add_request(prompt_of(tokenizer, 1), params(impl, "bounded"))
    outputs = {victim: [], other: []}
    for _ in range(6):
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.streams[victim].request.generated, "the victim generated tokens (setup)"
    engine.abort(victim)
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert outputs[victim][-1].finish_reason == "abort"
    text = "".join(out.text for out in outputs[other])
    check_json(text, outputs[other][-1].finish_reason, "bounded", "beside an aborted request")
    assert_all_pages_free(pools, "an aborted constrained request and a finished one")


# --- prompt logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [7, 64])
def test_score_is_the_log_softmax_of_one_forward_pass(impl, chat, step):
    """Engine.score: each prompt token's log-probability given the ones before it, for a
    prompt of 3 chunks (step 7) and of one."""
    model, tokenizer = chat
    prompt = prompt_of(tokenizer, 0)[:20]
    engine = engine_for(impl, model, tokenizer, prefill_step=step)
    scored = engine.score(prompt, 4)
    assert len(scored) == len(prompt) and scored[0] is None, (
        f"{len(scored)} entries for {len(prompt)} prompt tokens, the first {scored[0]!r}: one "
        "per prompt token, None for the first (nothing predicts it)"
    )
    lp = forward_logprobs(model, prompt)
    logits = np.array(model(mx.array([prompt]), 0, model.create_kv_cache())[0]).astype(np.float64)
    for j in range(1, len(prompt)):
        entry = scored[j]
        assert entry.token == prompt[j], f"entry {j} scores token {entry.token}, not {prompt[j]}"
        assert abs(entry.logprob - lp[j - 1, prompt[j]]) < TOL, (
            f"step {step}: prompt token {j}: {entry.logprob:.6f}, the oracle "
            f"{lp[j - 1, prompt[j]]:.6f}: {diagnose(entry.logprob, logits, j - 1, prompt[j])}"
        )
        check_top(entry.top, lp[j - 1], 4, f"step {step}: prompt token {j}", TOL)
    assert not engine.has_work, "score runs outside the batch: no request is left behind"


# --- n answers from one prefill (Tasks 5 and 6) ---------------------------------------------------


def shared_pool(impl, max_pages=None):
    return impl.TinyKvSharedPool(num_kv_heads=1, head_dim=2, page_size=PAGE, max_pages=max_pages)


def kv(values) -> tuple[mx.array, mx.array]:
    """Keys and values [1, 1, L, 2] whose token i holds the number values[i] (values negated)."""
    k = mx.array(values, dtype=mx.float32)[None, None, :, None] * mx.ones((1, 1, 1, 2))
    return k, -k


def page_values(pool, page: int) -> list[float]:
    return pool.key_pages[page, 0, :, 0].tolist()


def forked_pair(impl, pool, tokens: int):
    """A cache of `tokens` tokens (token i holds i + 1) and a second one sharing its pages the
    way a fork does: one more reference on each, the same token count."""
    first = impl.TinyKvPagedCache(pool)
    first.append(*kv([i + 1.0 for i in range(tokens)]))
    for page in first.page_table:
        pool.hold(page)
    second = impl.TinyKvPagedCache(pool)
    second.share(list(first.page_table), tokens)
    return first, second


@pytest.mark.parametrize("write", ["append", "reserve"])
def test_a_write_to_a_shared_partial_page_copies_it_first(impl, write):
    pool = shared_pool(impl)
    first, second = forked_pair(impl, pool, 6)  # pages [1 2 3 4] [5 6 . .]
    shared = first.page_table[-1]
    if write == "append":
        second.append(*kv([60.0]))
    else:
        slot = second.reserve(1)[0]
        pool.key_pages[slot // PAGE, :, slot % PAGE] = mx.full((1, 2), 60.0)
    assert page_values(pool, shared)[:3] == [5.0, 6.0, 0.0], (
        f"the first cache's last page now holds {page_values(pool, shared)[:3]}: the second "
        f"cache wrote into the page both hold ({write}). copy_on_write must give the writer a "
        "page of its own before the write"
    )
    own = second.page_table[-1]
    assert own != shared and second.page_table[:-1] == first.page_table[:-1], (
        f"page tables {first.page_table} and {second.page_table} after the write: only the "
        "partly filled last page is copied; the full pages stay shared"
    )
    assert page_values(pool, own)[:3] == [5.0, 6.0, 60.0], (
        f"the copy holds {page_values(pool, own)[:3]}, expected [5, 6, 60]: copy the shared "
        "page's contents (pool.copy_page) before the new token is written after them"
    )
    assert pool.refs[shared] == 1 and pool.refs[own] == 1, (
        f"references: the shared page {pool.refs.get(shared)}, the copy {pool.refs.get(own)}; "
        "both should be 1: the writer lets go of the shared page (pool.free) once it has its copy"
    )
    assert second.offset == 7 and first.offset == 6, "offsets after one write: 6 and 7"
    first.append(*kv([7.0]))  # the last holder writes in place: nobody else holds the page now
    assert first.page_table[-1] == shared, (
        "a page no other table holds was copied: copy only when the last page is shared"
    )
    first.release()
    second.release()
    assert pool.num_in_use == 0, f"{pool.num_in_use} pages still in use after both released"


def test_a_copy_that_finds_no_free_page_changes_nothing(impl):
    pool = shared_pool(impl, max_pages=2)
    first, second = forked_pair(impl, pool, 6)  # both pages of the pool, shared
    before = (list(second.page_table), dict(pool.refs), second.offset)
    with pytest.raises(impl.PagePoolExhausted):
        second.append(*kv([60.0]))
    assert (list(second.page_table), dict(pool.refs), second.offset) == before, (
        "a copy on write that found no free page changed the page table, the references or "
        "the offset: check that a page can be allocated before touching anything"
    )


def test_fork_prefix_shares_every_prompt_token_but_the_last(impl, chat):
    model, tokenizer = chat
    pools = model.create_kv_pools(PAGE, prefix_cache=True)
    prompt = prompt_of(tokenizer, 0)[:10]  # pages of 4: [0..3] [4..7] [8 9]
    parent = impl.Request(model, tokenizer, prompt, 16, 0, MAX_SEQ_LEN, pools)
    parent.try_prefill()
    fork = impl.Request(model, tokenizer, prompt, 16, 1, MAX_SEQ_LEN, pools)
    before = [pools[0].refs[p] for p in parent.kv_cache[0].page_table]
    shared = impl.fork_prefix(fork, parent)
    assert shared == 9 and fork.offset == 9, (
        f"fork_prefix returned {shared} and left the fork's offset at {fork.offset}; both "
        "should be 9: every prompt token but the last, whose logits give the fork its own first "
        "token (sharing all 10 leaves nothing to compute)"
    )
    for layer, (cache, parent_cache) in enumerate(zip(fork.kv_cache, parent.kv_cache)):
        assert cache.page_table == parent_cache.page_table and cache.offset == 9, (
            f"layer {layer}: the fork's page table {cache.page_table} (offset {cache.offset}), "
            f"the parent's {parent_cache.page_table}: all three pages, the partly filled one "
            "too, holding 9 tokens"
        )
    after = [pools[0].refs[p] for p in parent.kv_cache[0].page_table]
    assert after == [n + 1 for n in before], (
        f"references per page {before} -> {after}: the fork takes one more on each page it "
        "shares (pool.hold), or releasing either request frees a page the other still reads"
    )
    assert fork.entries[0] == parent.entries[0][:2], (
        f"the fork's entries {fork.entries[0]}, the parent's {parent.entries[0]}: copy those of "
        "the full pages it shares, so its own pages register after them in the prefix cache"
    )
    fork.release()
    parent.release()
    assert_all_pages_free(pools, "a parent and its fork released")


def run_choices(impl, model, tokenizer, prompt, params, n, pools, policy, on_step=None):
    engine = engine_for(impl, model, tokenizer, pools, policy, on_step=on_step)
    ids = engine.add_choices(prompt, params, n)
    got = {rid: [] for rid in ids}
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    return [got[rid] for rid in ids], engine.stats()


@pytest.mark.parametrize(
    "policy, in_place", [("alternate", False), ("hybrid", False), ("hybrid", True)]
)
def test_n_answers_are_forked_from_one_prefill(impl, chat, policy, in_place):
    model, tokenizer = chat
    prompt = prompt_of(tokenizer, 1)  # not a multiple of the page size: a partial page is shared
    assert (len(prompt) - 1) % PAGE, "the prompt's shared tokens end inside a page (setup)"
    admitted = []
    on_step = lambda step: step.kind == "admit" and admitted.append(step.tokens)
    sampled = params(impl, seed=3, max_tokens=12)
    pools = model.create_kv_pools(PAGE, read_in_place=in_place, prefix_cache=True)
    forked, stats = run_choices(impl, model, tokenizer, prompt, sampled, 3, pools, policy, on_step)
    assert stats["prompt_tokens_prefilled"] == len(prompt) + 2, (
        f"{stats['prompt_tokens_prefilled']} prompt tokens prefilled for 3 answers to a prompt "
        f"of {len(prompt)}: the first request prefills it, each fork only its last token "
        "(fork_prefix shares the rest)"
    )
    assert admitted[1:] == [len(prompt) - 1] * 2, (
        f"the forks were admitted with {admitted[1:]} cached tokens, expected "
        f"{len(prompt) - 1} each"
    )
    assert_all_pages_free(pools, f"3 forked answers ({policy}) have ended")
    plain = model.create_kv_pools(PAGE, read_in_place=in_place)  # no sharing: no forks
    alone, _ = run_choices(impl, model, tokenizer, prompt, sampled, 3, plain, policy)
    assert forked == alone, (
        "the forked answers differ from the same 3 requests each prefilling its own prompt: a "
        "fork must see exactly its parent's keys and values (shared pages, the partly filled "
        "one copied before it is written, not overwritten by another fork)"
    )


def test_forks_of_a_parent_that_ends_at_once_prefill_on_their_own(impl, chat):
    model, tokenizer = chat
    prompt = prompt_of(tokenizer, 2)
    pools = model.create_kv_pools(PAGE, prefix_cache=True)
    one = params(impl, seed=1, max_tokens=1)  # the parent's pages go back in its first step
    forked, _ = run_choices(impl, model, tokenizer, prompt, one, 3, pools, "hybrid")
    alone, _ = run_choices(impl, model, tokenizer, prompt, one, 3, None, "hybrid")
    assert forked == alone, "answers of forks whose parent had already ended"
    assert_all_pages_free(pools, "forks of a parent that ended at once")

"""The wire formats of serve.py's agents' features (Week 4 Day 8): log-probabilities in
OpenAI's two shapes, and response_format, whose JSON schema becomes the engine's grammar.

Log-probabilities come from the engine as entries (token id, logprob, top), top being the
(token id, logprob) pairs of the most likely tokens at that place, most likely first; a prompt's
first token, which nothing predicts, has logprob and top None. Chat writes an entry as
{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}; completions write the columns
{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}. A token's text is the
decode of its id alone (part of a UTF-8 character decodes to U+FFFD), its bytes its own bytes
(llguidance's view of the tokenizer), so that a client can join a character's pieces.

A schema is compiled by llguidance in this process, once per distinct schema (Grammars), so that
a schema it cannot follow is a 400 before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .tokenizer import grammar_tokenizer

# JSON has no -inf, the logprob of a token a grammar forbids: such a logprob goes on the wire as
# -9999.0, as vLLM sends it (and OpenAI's own floor).
LOGPROB_FLOOR = -9999.0
GRAMMARS_CACHED = 64  # distinct schemas whose grammar is kept (an agent sends the same few)
JSON_DEFAULTS = {"whitespace_flexible": False}  # compact JSON: no run of spaces to get lost in

Entry = tuple[int, float | None, tuple[tuple[int, float], ...] | None]


def wire(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenTexts:
    """Each token's text and bytes, as a logprob entry writes them (cached; llguidance's
    tokenizer, which gives the bytes, is built on first use: about a second for a real
    vocabulary, so `ready()` builds it off the event loop)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._llg: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def llg(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg is None:
                self._llg = grammar_tokenizer(self.tokenizer)  # the engine's own view of it
            return self._llg

    async def ready(self) -> None:
        if self._llg is None:
            await asyncio.to_thread(self.llg)

    def text(self, token: int) -> str:
        """The decode of the id alone; "" for an id past the tokenizer's (a padding row of the
        model's logits, which only a grammar's -inf can rank)."""
        text = self._texts.get(token)
        if text is None:
            inside = token < self.tokenizer.vocab_size
            text = self._texts[token] = self.tokenizer.decode([token]) if inside else ""
        return text

    def bytes(self, token: int) -> list[int]:
        if token >= self.tokenizer.vocab_size:
            return []
        return list(self.llg().decode_bytes([token]))


def chat_logprobs(entries: list[Entry], texts: TokenTexts) -> dict[str, Any]:
    """choices[i].logprobs of a chat answer (or of one chunk: its tokens)."""
    one = lambda token, logprob: {
        "token": texts.text(token),
        "logprob": wire(logprob),
        "bytes": texts.bytes(token),
    }
    content = [
        {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}
        for token, logprob, top in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: list[Entry], texts: TokenTexts, offset: int
) -> tuple[dict[str, Any], int]:
    """(choices[i].logprobs of a completion, or of one chunk, and the text offset after it).
    `offset`: where the first token's text starts in the choice's text. Each top_logprobs dict
    holds the top k and the chosen token (OpenAI's "up to logprobs + 1"), most likely first;
    two tokens with the same text keep the likelier."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    out["text_offset"] = []
    for token, logprob, top in entries:
        text = texts.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        best: dict[str, float] = {}
        for t, lp in (*top, (token, logprob)):
            best.setdefault(texts.text(t), wire(lp))
        out["token_logprobs"].append(wire(logprob))
        out["top_logprobs"].append(dict(sorted(best.items(), key=lambda kv: -kv[1])))
    return out, offset


def logprob_writer(kind: str, texts: TokenTexts):
    """(entries, offset) -> (the logprobs object of those tokens, the offset after them): chat's
    ("chat") or completions' ("text"), for server_stream.Choices."""
    if kind == "chat":
        return lambda entries, offset: (chat_logprobs(entries, texts), offset)
    return lambda entries, offset: completion_logprobs(entries, texts, offset)


# --- response_format ------------------------------------------------------------------------


class StrictBody(BaseModel):
    """Every request body's part: strict ("1" is not a number) and an unknown field is an
    error (extra="forbid")."""

    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(StrictBody):
    """response_format's json_schema: the schema the answer must fit (OpenAI's fields)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: Any = Field(None, alias="schema")  # `schema` would shadow pydantic's method
    strict: bool | None = None  # the schema is always followed, strict or not (as vLLM)

    @field_validator("schema_")
    @classmethod
    def _an_object(cls, schema: Any) -> Any:
        if schema is not None and not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return schema


class ResponseFormat(StrictBody):
    """{"type": "text"} (free text), "json_object" (any JSON object) or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' comes with type 'json_schema', and only with it")
        return self

    def wanted_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must fit; None for free text. A json_schema without a
        schema allows any JSON value."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        schema = self.json_schema.schema_
        return {} if schema is None else schema


class SchemaError(ValueError):
    """A schema llguidance cannot follow (its message)."""


class Grammars:
    """response_format and tools -> the llguidance grammar of SamplingParams.grammar, compiled
    once per distinct schema or Lark grammar: an LRU of GRAMMARS_CACHED, keyed by the schema's
    JSON with its key order kept (the order of `properties` is the order in which the answer
    writes them) or by the Lark text. One that does not compile is remembered too."""

    def __init__(self, texts: TokenTexts, size: int = GRAMMARS_CACHED) -> None:
        self.texts, self.size = texts, size
        self._cache: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
        self.compiled = 0  # schemas and grammars compiled (a cache miss each)

    async def grammar(self, response_format: ResponseFormat | None) -> str | None:
        """response_format's grammar (None for free text), or SchemaError."""
        schema = None if response_format is None else response_format.wanted_schema()
        return None if schema is None else await self.schema(schema)

    async def schema(self, schema: dict[str, Any]) -> str:
        """The grammar of a JSON schema, or SchemaError. Compiling runs off the loop."""
        key = "json:" + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        return await self._cached(key, self._compile, schema)

    async def lark(self, text: str) -> str:
        """The grammar of a Lark grammar (llguidance's dialect: %json inside), or SchemaError."""
        return await self._cached("lark:" + text, self._compile_lark, text)

    async def _cached(self, key: str, compile: Any, source: Any) -> str:
        hit = self._cache.get(key)
        if hit is None:
            hit = await asyncio.to_thread(compile, source)
            self._cache[key] = hit
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        grammar, problem = hit
        if problem is not None:
            raise SchemaError(problem)
        return grammar

    def _compile(self, schema: dict[str, Any]) -> tuple[str | None, str | None]:
        """(grammar, None), or (None, why llguidance refuses it)."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except Exception as e:  # llguidance's own checks raise, some of them
            self.compiled += 1
            return None, f"the JSON schema cannot be followed: {' '.join(str(e).split())}"
        return self._validate(grammar, "the JSON schema cannot be followed: ", _one_line)

    def _compile_lark(self, text: str) -> tuple[str | None, str | None]:
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except Exception as e:
            self.compiled += 1
            return None, f"the grammar does not compile: {' '.join(str(e).split())}"
        # a Lark grammar's message quotes the grammar after its first line
        return self._validate(grammar, "", _first_line)

    def _validate(self, grammar: str, prefix: str, brief: Any) -> tuple[str | None, str | None]:
        self.compiled += 1
        try:
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self.texts.llg()
            )
        except Exception as e:
            return None, prefix + " ".join(str(e).split())
        if failed:
            return None, prefix + "; ".join(brief(m) for m in messages)
        return grammar, None


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0]

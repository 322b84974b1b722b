"""Tokenizer loading (tokenizer.json + tokenizer_config.json), chat templates, streaming."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import llguidance
import tokenizers
from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .checkpoint_files import CheckpointError, read_json_object

REPLACEMENT_CHAR = "\ufffd"
TEMPLATE_SECONDS = 5.0  # a chat template renders in milliseconds; one that runs longer loops
TEMPLATE_MAX_ITEMS = 1_000_000  # the longest string or list that `*` or `**` may make


class ChatTemplateError(CheckpointError):
    """A chat template that failed to compile or render, on one line: `source` names the file
    the template came from, `detail` is what went wrong (a server shows its clients only
    that)."""

    def __init__(self, source: str | Path, error: Exception, what: str = "failed") -> None:
        self.source = source
        self.detail = " ".join(str(error).split()) or type(error).__name__
        if isinstance(getattr(error, "lineno", None), int):  # a syntax error says where
            self.detail += f" (line {error.lineno})"
        super().__init__(f"{source}: the chat template {what}: {self.detail}")


class ChatTemplateRefused(ChatTemplateError, SecurityError):
    """The sandbox refused what a template tried to do (still a jinja2 SecurityError)."""


class TemplateTimeout(TemplateError):
    """A template ran past TEMPLATE_SECONDS."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, plus a bound on what one expression can make: `'a' * 10**9` or `9**9**9`
    would run for minutes inside one step that no time check can interrupt."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise SecurityError(f"an exponent of {right} is too large")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    if len(seq) * n > TEMPLATE_MAX_ITEMS:
                        raise SecurityError(f"repeating a sequence {n} times is too much")
        return super().call_binop(context, operator, left, right)


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` plus what tokenizer_config.json adds to it."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        template_source: str | Path = "chat_template",
    ) -> None:
        self.hf_tokenizer = tokenizer
        self.config = dict(config or {})
        self.chat_template = chat_template or _pick_template(self.config.get("chat_template"))
        self.template_source = template_source  # the file it came from, for error messages
        self.eos_token = _token_content(self.config.get("eos_token")) or self._fallback_eos()
        self.eos_token_id = self._require_id(self.eos_token)
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.pad_token = _token_content(self.config.get("pad_token"))
        self.pad_token_id = self.token_to_id(self.pad_token) if self.pad_token else None
        self.eos_token_ids = self._collect_eos_ids(generation_config or {})

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self.hf_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Text to ids. Nothing is added, but special-token strings in `text` become their ids."""
        return self.hf_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Ids to text (invalid or incomplete UTF-8 becomes U+FFFD)."""
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf_tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf_tokenizer.id_to_token(token_id)

    def detokenizer(self) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for this tokenizer."""
        return StreamingDetokenizer(self)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the checkpoint's jinja chat template (sandboxed). Whatever
        goes wrong in the template is a ChatTemplateError naming its file."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token or "",
            "tools": None,
            "documents": None,
            **kwargs,
        }
        try:
            template = _jinja_env().from_string(self.chat_template)
            return _render_in_time(
                template,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                **variables,
            )
        except TemplateTimeout as e:
            raise ChatTemplateError(self.template_source, e, "ran too long") from e
        except SecurityError as e:
            raise ChatTemplateRefused(self.template_source, e, "was refused by the sandbox") from e
        except Exception as e:  # a template is a program from the checkpoint: a syntax error,
            # raise_exception() or a TypeError in an expression are all the template's failure
            raise ChatTemplateError(self.template_source, e) from e

    def _fallback_eos(self) -> str:
        for token in ("<|im_end|>", "<|endoftext|>", "</s>"):
            if self.token_to_id(token) is not None:
                return token
        raise ValueError("tokenizer_config.json names no eos_token and no known eos token exists")

    def _require_id(self, token: str) -> int:
        token_id = self.token_to_id(token)
        if token_id is None:
            raise ValueError(f"eos token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def _collect_eos_ids(self, generation_config: dict[str, Any]) -> set[int]:
        ids = {self.eos_token_id}
        endoftext = self.token_to_id("<|endoftext|>")
        if endoftext is not None:
            ids.add(endoftext)
        extra = generation_config.get("eos_token_id")
        if isinstance(extra, int):
            ids.add(extra)
        elif isinstance(extra, list):
            ids.update(int(i) for i in extra)
        return ids


class StreamingDetokenizer:
    """Turns a stream of token ids into text segments, never splitting a UTF-8 character.

    Each new token is decoded together with the previously finalized segment (as context for
    decoders that treat the start of a string specially); text ending in U+FFFD, an incomplete
    character, is held back until later tokens complete it. `finalize()` flushes the rest at
    the end of a stream and drops an incomplete character left at the very end, so the text
    never ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._context_start = 0  # first token of the segment finalized last
        self._pending_start = 0  # first token whose text is not in self.text yet

    def add_token(self, token_id: int) -> str:
        """Add one token id; return the text it finalizes ("" while a character is incomplete)."""
        self.tokens.append(int(token_id))
        context = self.tokens[self._context_start : self._pending_start]
        before = self.tokenizer.decode(context)
        after = self.tokenizer.decode(self.tokens[self._context_start :])
        if after.endswith(REPLACEMENT_CHAR) or not after.startswith(before):
            return ""
        return self._accept(after[len(before) :])

    def finalize(self) -> str:
        """Flush what is held back, without a trailing incomplete character.

        Afterwards `text == tokenizer.decode(tokens).rstrip("\ufffd")`: bytes at the end that
        do not form a complete UTF-8 character (they decode to U+FFFD) are dropped.
        """
        full = self.tokenizer.decode(self.tokens).rstrip(REPLACEMENT_CHAR)
        rest = full[len(self.text) :] if full.startswith(self.text) else full
        self.text = full
        self._context_start = self._pending_start = len(self.tokens)
        return rest

    def _accept(self, segment: str) -> str:
        self.text += segment
        self._context_start = self._pending_start
        self._pending_start = len(self.tokens)
        return segment


@functools.cache
def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer (Week 4 Day 8), built once per tokenizer (about a
    second for a real vocabulary): every token's bytes, and the EOS token a complete grammar
    allows. The engine's grammars and the server's checks of them both use this one."""
    return llguidance.LLTokenizer(tokenizer.hf_tokenizer.to_str(), eos_token=tokenizer.eos_token_id)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json, tokenizer_config.json and (if present) generation_config.json.
    A missing or unreadable file raises CheckpointError, naming it."""
    path = Path(path)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(f"tokenizer.json not found in {path}")
    try:
        hf_tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{tokenizer_file}: not a valid tokenizer file ({detail})") from None
    config = _read_json(path / "tokenizer_config.json")
    generation_config = _read_json(path / "generation_config.json")
    template_file = path / "chat_template.jinja"
    template, source = None, path / "tokenizer_config.json"
    if not config.get("chat_template") and template_file.is_file():
        try:
            template, source = template_file.read_text(encoding="utf-8"), template_file
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{template_file}: cannot read it ({e})") from None
    try:
        return Tokenizer(hf_tokenizer, config, generation_config, template, source)
    except (ValueError, TypeError, AttributeError) as e:  # e.g. an eos_token not in the vocabulary
        raise CheckpointError(f"{path / 'tokenizer_config.json'}: {e}") from None


def check_chat_text(messages: list[dict[str, Any]]) -> None:
    """ValueError for a conversation with no text in it. A raw prompt without text has no
    tokens and is refused for that; through the chat template it still has the template's
    markup, which the model answers with noise."""
    if not any(str(m.get("content") or "").strip() for m in messages):
        raise ValueError("the prompt is empty or only whitespace: there is nothing to answer")


def check_chat_template(tokenizer: Tokenizer) -> None:
    """Render a one-message conversation, so that a template that cannot render even that
    stops a server at start-up (a ChatTemplateError naming its file) instead of failing every
    chat request. Nothing to do without a template."""
    if tokenizer.chat_template:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path) if path.is_file() else {}


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _pick_template(template: Any) -> str | None:
    """A chat_template is a string, or a list of {"name", "template"} with a "default" one."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _render_in_time(template: Any, **variables: Any) -> str:
    """template.render(**variables), stopped with TemplateTimeout after TEMPLATE_SECONDS: a
    trace function looks at the clock on every line of the compiled template (its code is
    Python, from a file named "<template>"), so that a loop of loops cannot hang a server."""
    deadline = time.monotonic() + TEMPLATE_SECONDS

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"it ran for more than {TEMPLATE_SECONDS:g} s (a loop?)")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return on_line(frame, event, arg) if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return template.render(**variables)
    finally:
        sys.settrace(previous)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env

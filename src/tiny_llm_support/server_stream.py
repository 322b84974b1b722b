"""From the engine's outputs to OpenAI's answers (serve.py): the outputs of the requests of one
response, merged in the order they come, as one JSON object or as server-sent events. Choices
keeps what each choice has said: an echoed prompt first (completions' echo), then its outputs,
with their logprob entries when asked for, and with tools, the calls in its text
(server_tool_calls)."""

from __future__ import annotations

import asyncio
import os
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

from .server_api import ApiError
from .server_channels import Channel
from .server_replies import Reply, sse, usage
from .server_tool_calls import ToolCallParser, finish_reason, without_index


class Choices:
    """The choices of one response, n per prompt (choice p * n + j is answer j to prompt p, as
    OpenAI numbers them), as their outputs come. `write`: entries and a text offset -> (the
    logprobs object of those tokens, the offset after them), chat's or completions'
    (server_formats); None when the request did not ask for logprobs. `tools`: the names of
    the functions whose calls are parsed out of the text; None: the text is all content."""

    def __init__(
        self,
        prompts: list[list[int]],
        write: Callable | None,
        n: int = 1,
        tools: list[str] | None = None,
    ) -> None:
        self.prompts, self.write, self.n, self.tools = prompts, write, n, tools
        count = len(prompts) * n
        self.echoed: list[tuple[str, list] | None] = [None] * count
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.entries: list[list] = [[] for _ in range(count)]
        self.offsets = [0] * count  # completions' text_offset of each choice's next token
        self.last: list[Any] = [None] * count
        self.parsers = None if tools is None else [ToolCallParser(tools) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.last)

    def echo(self, i: int, text: str, entries: list) -> None:
        """Choice i starts with its prompt: its text, and its tokens' entries."""
        self.echoed[i] = (text, entries)
        self.texts[i].append(text)
        self.entries[i] += entries

    def add(self, i: int, output: Any) -> list:
        """Record an output of choice i; returns its tokens' entries."""
        self.last[i] = output
        self.texts[i].append(output.text)
        entries = (output.logprobs or []) if self.write is not None else []
        self.entries[i] += entries
        return entries

    def piece(self, i: int, entries: list) -> dict | None:
        """The logprobs object of a chunk of choice i (its text offsets following on)."""
        if self.write is None:
            return None
        logprobs, self.offsets[i] = self.write(entries, self.offsets[i])
        return logprobs

    def split(self, i: int, text: str, final: bool) -> tuple[str, list[dict]]:
        """A stream's new text of choice i -> (the content that may be sent now, the tool
        calls that closed); at its `final` output, what was held back too."""
        if self.parsers is None:
            return text, []
        content, calls = self.parsers[i].feed(text)
        return content + (self.parsers[i].finish() if final else ""), calls

    def finish_reason(self, i: int) -> str:
        """The last output's ("tool_calls" if it stopped after calls), or "length" for a
        choice that generated nothing (max_tokens 0)."""
        reason = "length" if self.last[i] is None else self.last[i].finish_reason
        return reason if self.parsers is None else finish_reason(reason, self.parsers[i].calls)

    def whole(self) -> list[tuple[str | None, str, dict | None, list[dict]]]:
        """(content, finish_reason, logprobs, tool calls) of each choice, at the end."""
        out = []
        for i in range(len(self)):
            text, reason, calls = "".join(self.texts[i]), self.finish_reason(i), []
            if self.tools is not None:
                text, calls = ToolCallParser(self.tools).parse(text)
                reason, calls = finish_reason(reason, len(calls)), list(map(without_index, calls))
            logprobs = None if self.write is None else self.write(self.entries[i], 0)[0]
            out.append((text, reason, logprobs, calls))
        return out

    def usage(self) -> dict[str, Any]:
        """The counts of each choice's last output, added up (a choice that generated
        nothing: its prompt alone); each prompt counts once however many answers it has, and
        its cached tokens are those of its first answer (the others start from its pages)."""
        last = [o for o in self.last if o is not None]
        firsts = [o for o in self.last[:: self.n] if o is not None]
        return usage(
            sum(len(p) for p in self.prompts),
            sum(o.completion_tokens for o in last),
            sum(o.cached_tokens for o in firsts),
        )


async def outputs(channel: Channel) -> AsyncIterator[Any]:
    """The engine's outputs for one request, up to the one with a finish reason."""
    while True:
        output = await channel.next()
        if output.finish_reason == "abort":
            raise ApiError(503, "the request was aborted", kind="server_error")
        yield output
        if output.finish_reason is not None:
            return


async def indexed(channels: list[Channel]) -> AsyncIterator[tuple[int, Any]]:
    """(i, output) of every request as the outputs come, until each has finished; the first
    ApiError of any request is raised. One request is read directly; several through one
    queue that a task per request fills."""
    if len(channels) == 1:
        async for output in outputs(channels[0]):
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, channel: Channel) -> None:
        try:
            async for output in outputs(channel):
                merged.put_nowait((i, output))
        except ApiError as e:
            merged.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(channels)]
    try:
        running = len(channels)
        while running:
            i, item = await merged.get()
            if isinstance(item, ApiError):
                raise item
            running -= item.finish_reason is not None
            yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(channels: list[Channel], choices: Choices) -> None:
    """Every output of every choice (channels[i] is choice i's; none with max_tokens 0)."""
    async for i, output in indexed(channels):
        choices.add(i, output)


async def sse_events(channels: list[Channel], reply: Reply, choices: Choices) -> AsyncIterator[str]:
    """An echoed prompt's chunk first, chunks with the new text (and its tokens' logprobs),
    one with the finish reason for each choice, the usage if asked for, then [DONE]. A failure
    half way ends the stream with an error object, as OpenAI's does."""
    if reply.kind == "chat":
        for i in range(len(choices)):
            yield sse(reply.chunk(first=True, index=i))
    stamp = stamping()
    try:
        for i, echoed in enumerate(choices.echoed):
            if echoed is not None:
                yield sse(reply.chunk(echoed[0], index=i, logprobs=choices.piece(i, echoed[1])))
            if not channels:  # max_tokens 0: the prompt was all
                yield sse(reply.chunk(finish_reason="length", index=i))
        async for i, output in indexed(channels):
            entries = choices.add(i, output)
            final = output.finish_reason is not None
            text, calls = choices.split(i, output.text, final)
            if text or entries or calls:
                logprobs = choices.piece(i, entries)
                chunk = reply.chunk(text, index=i, logprobs=logprobs, tool_calls=calls)
                if stamp:
                    chunk["tiny_llm_sampled_at"] = output.sampled_at
                yield sse(chunk)
            if final:
                yield sse(reply.chunk(finish_reason=choices.finish_reason(i), index=i))
        if reply.include_usage:
            yield sse(reply.usage_chunk(choices.usage()))
    except ApiError as e:
        yield sse(e.body())
    except Exception as e:  # a bug here must not leave the client waiting for [DONE]
        yield sse(server_error(e).body())
    yield sse("[DONE]")


def server_error(error: Exception) -> ApiError:
    """A bug on the server's side as a 500 with an OpenAI error object; the traceback goes
    to the log."""
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    message = f"the server failed: {type(error).__name__}: {error}"
    return ApiError(500, message, kind="server_error")


def stamping() -> bool:
    """TINY_LLM_STAMP_TOKENS=1: each stream chunk also carries `tiny_llm_sampled_at`, the
    engine's clock when its tokens were sampled (for bench-token-delivery; off by default, so
    the wire format is OpenAI's)."""
    return os.environ.get("TINY_LLM_STAMP_TOKENS") == "1"

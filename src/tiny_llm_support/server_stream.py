"""From the engine's outputs to OpenAI's answers (serve.py): the outputs of the requests of one
response, merged in the order they come, as one JSON object or as server-sent events."""

from __future__ import annotations

import asyncio
import os
import sys
import traceback
from collections.abc import AsyncIterator
from typing import Any

from .server_api import ApiError
from .server_channels import Channel
from .server_replies import Reply, sse, usage


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


async def sse_events(channels: list[Channel], reply: Reply) -> AsyncIterator[str]:
    """Chunks with the new text, one with the finish reason for each choice, the usage if
    asked for, then [DONE]. A failure half way ends the stream with an error object, as
    OpenAI's does."""
    if reply.kind == "chat":
        yield sse(reply.chunk(first=True))
    stamp = stamping()
    last: list[Any] = [None] * len(channels)
    try:
        async for i, output in indexed(channels):
            last[i] = output
            if output.text:
                chunk = reply.chunk(output.text, index=i)
                if stamp:
                    chunk["tiny_llm_sampled_at"] = output.sampled_at
                yield sse(chunk)
            if output.finish_reason is not None:
                yield sse(reply.chunk(finish_reason=output.finish_reason, index=i))
        if reply.include_usage:
            yield sse(reply.usage_chunk(usage_of(last)))
    except ApiError as e:
        yield sse(e.body())
    except Exception as e:  # a bug here must not leave the client waiting for [DONE]
        yield sse(server_error(e).body())
    yield sse("[DONE]")


def usage_of(last: list[Any]) -> dict[str, Any]:
    """The usage of a response: the counts of each request's last output, added up."""
    return usage(
        sum(o.prompt_tokens for o in last),
        sum(o.completion_tokens for o in last),
        sum(o.cached_tokens for o in last),
    )


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

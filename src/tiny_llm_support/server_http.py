"""The HTTP plumbing of serve.py's handlers (server.py): a request body read within a size and
a time limit, and every error, the server's own and Starlette's, as an OpenAI error object."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .server_api import ApiError
from .server_stream import server_error

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt the context can hold
DRAIN_BYTES = 16 << 20  # read (and drop) a too-large body up to this size before answering
BODY_TIMEOUT_S = 20  # a request body must arrive whole within this (a stalled upload: 408)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or ApiError(413) past `limit` bytes, or ApiError(408) when it does not arrive
    within BODY_TIMEOUT_S (a stalled upload would hold its connection forever). A larger body
    is still read (up to DRAIN_BYTES) so that the client, which is still sending, receives the
    413 instead of a connection reset."""
    try:
        body, size = await asyncio.wait_for(_read(request, limit), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {BODY_TIMEOUT_S} s", code="timeout"
        ) from None
    if size > limit:
        raise ApiError(
            413, f"the request body is over the limit of {limit} bytes", code="request_too_large"
        )
    return body


async def _read(request: Request, limit: int) -> tuple[bytes, int]:
    """(the body's first `limit` bytes, its size as far as it was read)."""
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            body += chunk
        elif size > DRAIN_BYTES:
            break
    return bytes(body), size


async def error_response(request: Request, error: ApiError) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def http_error_response(request: Request, error: HTTPException) -> Response:
    """Starlette's own errors (no such route, wrong method) as OpenAI error objects."""
    message = f"{request.method} {request.url.path}: {error.detail}"
    error = ApiError(error.status_code, message, headers=error.headers)  # 405: its Allow header
    return await error_response(request, error)


async def server_error_response(request: Request, error: Exception) -> Response:
    """A bug on the server's side: a 500 with an OpenAI error object, the traceback in the log."""
    return await error_response(request, server_error(error))

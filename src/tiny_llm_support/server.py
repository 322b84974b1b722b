"""The HTTP side of serve.py: an OpenAI-compatible API (FastAPI on uvicorn) around an engine
that runs in a process of its own (server_engine.EngineClient, engine_process.py).

    POST /v1/chat/completions   the chat template, then generation; streamed or not
    POST /v1/completions        a text or token-id prompt
    GET  /v1/models             the one model served
    GET  /health                200 while the engine runs; 503 while it restarts or once it
                                has stopped (the body says which, and the engine's failures)
    GET  /metrics               engine.stats() in Prometheus' text format, the prefix hit rate
                                and speculative decoding's acceptance rate
    GET  /                      the live page: a chat box beside the engine as it runs (static/)
    GET  /events                the engine's snapshots as server-sent events, for that page
                                (these two and the page's files: server_page.py)

A handler checks the request (server_api), turns it into token ids and sampling settings, and
hands it to the engine process; it never calls the model. The engine's outputs come back on the
request's Channel and go out as one JSON response or as server-sent events. A client that hangs
up gets its request aborted, so its slot and pages serve someone else.

For agents and evaluators (Week 4 Day 8): logprobs; completions' echo, the prompt's logprobs
scored by the engine process between two steps (max_tokens 0: nothing generated);
response_format, a JSON schema compiled here (once per schema) into the engine's grammar, so that
a bad one is a 400 before the engine sees anything (server_formats); `n` answers to each prompt,
added by one engine command (Engine.add_choices: the prompt prefilled once); and tools on chat:
rendered by the chat template (chat_format), a call enforced by a grammar for tool_choice
"required" or a named function (server_tools), the model's calls parsed out of its text
(server_tool_calls). A solution whose Week 4 Day 8 tasks are not written yet serves plain
requests and refuses these with a 400 naming the task (server_features).

With --api-key, /v1/* and /events need "Authorization: Bearer <key>"; the page and its two files
need none (they hold no data), and the page, told by its <meta name="api-key"> that a key is
needed, asks for it and sends it in that header (never in a URL, which access logs keep).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .chat_format import render_with_tools
from .server_api import ApiError, ChatRequest, CompletionRequest, parse_request, sampling_settings
from .server_channels import Channel
from .server_engine import EngineClient
from .server_features import refusal
from .server_formats import Grammars, SchemaError, TokenTexts, logprob_writer
from .server_http import (
    MAX_BODY_BYTES,
    error_response,
    http_error_response,
    read_body,
    server_error_response,
)
from .server_metrics import prometheus_text
from .server_page import LivePage
from .server_replies import EVENT_STREAM, Reply
from .server_stream import Choices, collect, sse_events
from .server_tools import ToolError, ToolPlan, plan_tools
from .tokenizer import ChatTemplateError, check_chat_text


@dataclass
class ServerSettings:
    """What the HTTP side needs to know about the model and the engine."""

    model_id: str  # the name clients send as "model"
    max_seq_len: int  # prompt + answer tokens of one request
    vocab_size: int
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_body_bytes: int = MAX_BODY_BYTES


class OpenAIServer(LivePage):
    """The request handlers, around one EngineClient."""

    def __init__(
        self,
        service: EngineClient,
        tokenizer: Any,
        make_params: Callable[..., Any],
        settings: ServerSettings,
    ) -> None:
        self.service, self.tokenizer, self.make_params = service, tokenizer, make_params
        self.settings = settings
        self.started = int(time.time())
        self.texts = TokenTexts(tokenizer)  # logprobs' token texts and bytes
        self.grammars = Grammars(self.texts)  # response_format's schemas, compiled

    def app(self) -> FastAPI:
        """The FastAPI app. No /docs page: FastAPI's loads its scripts from a CDN."""

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            self.service.attach(asyncio.get_running_loop())
            yield

        app = FastAPI(
            title="tiny-llm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
        )
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET", "HEAD"])  # load tools probe
        app.add_api_route("/metrics", self.metrics, methods=["GET", "HEAD"])  # with HEAD
        app.add_api_route("/", self.page, methods=["GET"])
        app.add_api_route("/static/{name}", self.static, methods=["GET"])
        app.add_api_route("/events", self.events, methods=["GET"])
        app.add_exception_handler(ApiError, error_response)
        app.add_exception_handler(HTTPException, http_error_response)
        app.add_exception_handler(Exception, server_error_response)
        return app

    # --- endpoints ----------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = parse_request(await read_body(request, self.settings.max_body_bytes), ChatRequest)
        self._check_model(body.model)
        try:
            tools = await plan_tools(body.tools, body.tool_choice, self.grammars)
        except ToolError as e:
            raise ApiError(400, str(e), e.param) from e
        text = self._chat_prompt(body.conversation(), tools)
        return await self._generate(request, "chat", body, [self._encode(text, "messages")], tools)

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        raw = await read_body(request, self.settings.max_body_bytes)
        body = parse_request(raw, CompletionRequest)
        self._check_model(body.model)
        prompts = [p if isinstance(p, list) else self._encode(p, "prompt") for p in body.prompt]
        return await self._generate(request, "text", body, prompts)

    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        self._authorize(request)
        self._check_model(model_id)
        return self._model_card()

    async def health(self) -> Response:
        status, body = self.service.health()
        return JSONResponse(body, status_code=status)

    async def metrics(self) -> Response:
        text = prometheus_text(self.service.stats, self.service.refused_busy)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # --- checks -------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer"  # the scheme is case-insensitive (RFC 9110)
        if not (hmac.compare_digest(given.strip().encode(), key.encode()) and bearer):
            raise ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def _check_model(self, model_id: str) -> None:
        if model_id != self.settings.model_id:
            raise ApiError(
                404,
                f"the model '{model_id}' does not exist: this server serves "
                f"'{self.settings.model_id}' (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def _chat_prompt(self, conversation: list[dict], tools: ToolPlan | None) -> str:
        """The conversation (and the tools) through the chat template; 400 for one without
        text, and for one the template refuses (its message, not the server's file names)."""
        try:
            check_chat_text(conversation)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from e
        try:
            return render_with_tools(self.tokenizer, conversation, tools and tools.tools)
        except ValueError as e:  # a ChatTemplateError, or no template at all
            detail = e.detail if isinstance(e, ChatTemplateError) else str(e)
            raise ApiError(
                400, f"the chat template refused 'messages': {detail}", "messages"
            ) from e

    def _check_prompt(self, ids: list[int], field: str) -> None:
        """An empty prompt, an id outside the vocabulary, or one longer than the context."""
        if not ids:
            raise ApiError(400, f"'{field}' is empty: there is no token to start from", field)
        vocab = self.settings.vocab_size
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise ApiError(
                400,
                f"'{field}' holds token id {outside}, outside the vocabulary 0..{vocab - 1}",
                param=field,
            )
        limit = self.settings.max_seq_len
        if len(ids) >= limit:  # the answer needs room for one token at least
            raise ApiError(
                400,
                f"the context is {limit} tokens (--max-seq-len), prompt and answer together, "
                f"but '{field}' has {len(ids)} tokens, which leaves no room for an answer: "
                "shorten it",
                param=field,
                code="context_length_exceeded",
            )

    def _encode(self, text: str, field: str) -> list[int]:
        """The text's token ids; 400 for a text the tokenizer refuses."""
        try:
            return self.tokenizer.encode(text)
        except Exception as e:  # e.g. a lone surrogate that slipped past the body's checks
            raise ApiError(400, f"'{field}' cannot be tokenized: {e}", param=field) from e

    async def _sampling_params(self, body: Any, tools: ToolPlan | None) -> Any:
        """The request's SamplingParams, its response_format's grammar compiled, or the grammar
        of an enforced tool call."""
        try:
            grammar = await self.grammars.grammar(body.response_format)
        except SchemaError as e:
            raise ApiError(400, f"invalid 'response_format': {e}", "response_format") from e
        if tools is not None and tools.grammar is not None:
            if grammar is not None:
                message = (
                    "'response_format' cannot apply to an answer that tool_choice makes a call"
                )
                raise ApiError(400, message, "response_format")
            grammar = tools.grammar
        try:
            params = self.make_params(**sampling_settings(body, grammar))
            params.check()
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        return params

    def _check_features(self, params: Any, n: int, tools: ToolPlan | None) -> None:
        """400 for a request that needs a Week 4 Day 8 task the solution has not written yet
        (the engine process found out at start-up: server_features)."""
        enforced = tools is not None and tools.grammar is not None
        refused = refusal(self.service.info.get("missing", {}), params, n, enforced)
        if refused is not None:
            raise ApiError(400, refused[1], refused[0], code="not_implemented")

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.settings.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "tiny-llm",
        }

    # --- generation ---------------------------------------------------------------------------

    async def _generate(
        self,
        request: Request,
        kind: str,
        body: Any,
        prompts: list[list[int]],
        tools: ToolPlan | None = None,
    ) -> Response:
        """Check, submit the n answers to every prompt (one engine command each: a completion
        may hold several prompts; answer j to prompt p is choice p * n + j; none with
        max_tokens 0), and with echo and logprobs a score of each prompt, wait until the engine
        has taken them all, then answer."""
        field = "messages" if kind == "chat" else "prompt"
        for i, ids in enumerate(prompts):
            self._check_prompt(ids, field if len(prompts) == 1 else f"{field}[{i}]")
        n = body.choices()
        params = await self._sampling_params(body, tools)
        self._check_features(params, n, tools)
        k = params.logprobs
        if k is not None:
            await self.texts.ready()
        groups = [[Channel(ids, params) for _ in range(n)] for ids in prompts]
        channels = [c for group in groups for c in group] if body.limit != 0 else []
        scoring = body.echoes and k is not None
        scores = [Channel(ids, None, score=k) for ids in prompts] if scoring else []
        try:
            for channel in scores:
                self.service.submit(channel)  # a 503 is raised here
            for group in groups if channels else []:
                self.service.submit(*group)  # a 429 or 503 is raised here
            for channel in channels:
                await channel.next()  # Accepted, or the ApiError of a refusal is raised
            scored = [(await channel.next()).entries for channel in scores]
        except BaseException:  # a refusal, or the client left: the others are aborted
            self._cancel(channels)
            raise
        write = None if k is None else logprob_writer(kind, self.texts)
        parsed = tools.names if tools is not None and tools.parse else None
        choices = Choices(prompts, write, n, parsed)
        if body.echoes:
            for i, ids in enumerate(prompts):
                entries = [(ids[0], None, None), *scored[i][1:]] if scores else []
                prompt = body.prompt[i]
                text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
                for j in range(n):
                    choices.echo(i * n + j, text, entries)
        hangup = asyncio.create_task(self._cancel_on_hangup(request, channels))
        options = body.stream_options
        reply = Reply(kind, self.settings.model_id, bool(options and options.include_usage))
        if body.stream:
            events = self._stream(channels, reply, choices, hangup)
            return StreamingResponse(events, media_type="text/event-stream", headers=EVENT_STREAM)
        return await self._respond(channels, reply, choices, hangup)

    def _cancel(self, channels: list[Channel]) -> None:
        """Abort every request of a response (those already finished are left alone)."""
        for channel in channels:
            self.service.cancel(channel)

    async def _cancel_on_hangup(self, request: Request, channels: list[Channel]) -> None:
        """Abort the requests once their client disconnects. (Nothing else notices a client
        that waits quietly for a response that is not streamed.)"""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self._cancel(channels)

    async def _respond(
        self, channels: list[Channel], reply: Reply, choices: Choices, hangup: asyncio.Task
    ) -> Response:
        """The whole answer as one JSON object."""
        try:
            await collect(channels, choices)
        finally:
            hangup.cancel()
            self._cancel(channels)  # after an error in one, the others
        return JSONResponse(reply.response(choices.whole(), choices.usage()))

    async def _stream(
        self, channels: list[Channel], reply: Reply, choices: Choices, hangup: asyncio.Task
    ):
        """The answer as server-sent events; a stream left early aborts its requests."""
        try:
            async for event in sse_events(channels, reply, choices):
                yield event
        finally:
            hangup.cancel()
            self._cancel(channels)

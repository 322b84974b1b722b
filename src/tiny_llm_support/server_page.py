"""The live page of serve.py: GET / (a chat box beside the engine as it runs), its two files in
static/, and GET /events, the engine's snapshots as server-sent events. The engine process makes
the snapshots (live_view.py); EngineClient hands each to every /events client's Subscriber.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib import resources

from fastapi import Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from .server_api import ApiError
from .server_replies import EVENT_STREAM, sse

FIRST_SNAPSHOT = '<script id="first-snapshot" type="application/json">{}</script>'
STATIC_FILES = {"live.css": "text/css", "live.js": "text/javascript"}  # the page's, in static/
KEEPALIVE_S = 15  # an idle /events stream sends a comment this often


class LivePage:
    """The live page's handlers, a base of OpenAIServer (server.py), whose `settings` (the API
    key), `service` (the EngineClient) and `_authorize` they use."""

    async def page(self) -> Response:
        """index.html, its <meta name="api-key"> set to "required" when there is a key;
        without one, the engine's latest snapshot is in the page, drawn before any event."""
        html = static_text("index.html")
        if self.settings.api_key is not None:
            html = html.replace(
                'name="api-key" content="none"', 'name="api-key" content="required"'
            )
        elif self.service.snapshot is not None:
            first = self.service.snapshot.replace("<", "\\u003c")  # no </script> inside
            html = html.replace(FIRST_SNAPSHOT.format("null"), FIRST_SNAPSHOT.format(first))
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    async def static(self, name: str) -> Response:
        if name not in STATIC_FILES:
            raise ApiError(404, f"GET /static/{name}: no such file")
        headers = {"Cache-Control": "no-cache"}
        return Response(static_text(name), media_type=STATIC_FILES[name], headers=headers)

    async def events(self, request: Request) -> Response:
        """A snapshot of the engine whenever it changes (at most 20 a second), as server-sent
        events `data: {...}`, until the client leaves or the server stops. The engine process
        makes them (live_view.EngineWatch); this handler only reads its own queue."""
        self._authorize(request)
        return StreamingResponse(
            self._watch(), media_type="text/event-stream", headers=EVENT_STREAM
        )

    async def _watch(self) -> AsyncIterator[str]:
        """Subscribed only once the response streams, so that the finally below always runs."""
        subscriber = self.service.subscribe()
        try:
            while (snapshot := await subscriber.next(KEEPALIVE_S)) is not None:
                yield sse(snapshot) if snapshot else ": keep-alive\n\n"
        finally:
            self.service.unsubscribe(subscriber)


def static_text(name: str) -> str:
    """A file of the live page, read at each request (edit it, reload the page)."""
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")

"""The UI's login check, slowed down against password guessing, per client address.

Gradio calls `auth(username, password)` for each login and tells it nothing about the caller, so a small
ASGI middleware (`ClientAddress`, installed by ui.app) remembers the caller's address for the check. After
FREE_TRIES wrong logins in a row from one address, every attempt from it, right or wrong, is refused
unchecked (HTTP 429, saying how long to wait) until a lockout has passed; the lockout doubles with each
further failure up to MAX_LOCK_S, and a successful login resets it. A guesser then gets a few tries a
minute instead of hundreds a second, and does not lock out the owner at another address.

Gradio's login page (what `GET /` serves a visitor without a session) still embeds the API description of
every event, whose parameter choices and defaults name files in the allowed folders, the ready recipes and
the runs folder. `HideBeforeLogin` blanks that description on any page that asks for a login, so nothing
about the server's files is shown before one; after login the page is gradio's own.
"""

from __future__ import annotations

import hmac
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

FREE_TRIES = 5
FIRST_LOCK_S = 1.0
MAX_LOCK_S = 60.0
MAX_CLIENTS = 10_000  # addresses remembered; the oldest is forgotten first

_client: ContextVar[str] = ContextVar("finetune_ui_client", default="unknown")


class ClientAddress:
    """ASGI middleware: makes the caller's address known to the login check of the same request."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        client = scope.get("client")
        token = _client.set(client[0] if client else "unknown")
        try:
            await self.app(scope, receive, send)
        finally:
            _client.reset(token)


_PAGE_CONFIG = re.compile(rb"window\.gradio_config = (.*?);</script>", re.S)
_API_INFO = re.compile(rb"(window\.gradio_api_info = ).*?(;</script>)", re.S)


def hide_api_info(page: bytes) -> bytes:
    """A gradio HTML page with its embedded API description emptied when the page asks for a login."""
    config = _PAGE_CONFIG.search(page)
    try:
        login_page = config is not None and json.loads(config.group(1)).get("auth_required") is True
    except ValueError:
        login_page = False
    return _API_INFO.sub(rb"\1{}\2", page) if login_page else page


class HideBeforeLogin:
    """ASGI middleware: passes every response on, but an HTML page through `hide_api_info`."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":  # HEAD carries no page
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def filtered_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if not headers.get(b"content-type", b"").startswith(b"text/html"):
                    await send(message)
                    return
                start = message  # held back until the whole page is known
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            page = hide_api_info(b"".join(body))
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
            await send({"type": "http.response.body", "body": page})

        await self.app(scope, receive, filtered_send)


class LoginGuard:
    """A callable for gradio's `auth=` that checks one user:password and rate-limits failures per client."""

    def __init__(self, user: str, password: str, clock: Callable[[], float] = time.monotonic):
        self._user, self._password = user.encode(), password.encode()
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (failures, locked until)
        self.checked = 0  # passwords actually compared (tests count them)

    def retry_after(self, client: str | None = None) -> float:
        """Seconds until the next login attempt from `client` (default: the current caller) is evaluated."""
        _, until = self._clients.get(client or _client.get(), (0, 0.0))
        return max(0.0, until - self._clock())

    def __call__(self, username: str, password: str) -> bool:
        client = _client.get()
        with self._lock:
            wait = self.retry_after(client)
            if wait > 0:
                from fastapi import HTTPException

                raise HTTPException(status_code=429, headers={"Retry-After": str(math.ceil(wait))},
                                    detail=f"too many failed logins: try again in {math.ceil(wait)} s")
            self.checked += 1
            ok = hmac.compare_digest(username.encode(), self._user) & hmac.compare_digest(
                password.encode(), self._password)
            failures = 0 if ok else self._clients.get(client, (0, 0.0))[0] + 1
            self._clients.pop(client, None)
            if failures:
                lock = min(MAX_LOCK_S, FIRST_LOCK_S * 2 ** (failures - FREE_TRIES)) if failures >= FREE_TRIES else 0
                self._clients[client] = (failures, self._clock() + lock)
                while len(self._clients) > MAX_CLIENTS:
                    self._clients.popitem(last=False)
            return ok

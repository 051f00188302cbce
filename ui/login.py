"""The UI's login check, slowed down against password guessing.

Gradio calls `auth(username, password)` for each login and gives it nothing about the client, so the limit
is for the whole server: after FREE_TRIES wrong logins in a row every attempt, right or wrong, is refused
unchecked (HTTP 429, saying how long to wait) until a lockout has passed; the lockout doubles with each
further failure up to MAX_LOCK_S, and a successful login resets it. A guesser then gets a few tries a
minute instead of hundreds a second; the owner waits at most MAX_LOCK_S.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable

FREE_TRIES = 5
FIRST_LOCK_S = 1.0
MAX_LOCK_S = 60.0


class LoginGuard:
    """A callable for gradio's `auth=` that checks one user:password and rate-limits failures."""

    def __init__(self, user: str, password: str, clock: Callable[[], float] = time.monotonic):
        self._user, self._password = user.encode(), password.encode()
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._locked_until = 0.0
        self.checked = 0  # passwords actually compared (tests count them)

    def retry_after(self) -> float:
        """Seconds until the next login attempt is evaluated (0 when not locked)."""
        return max(0.0, self._locked_until - self._clock())

    def __call__(self, username: str, password: str) -> bool:
        with self._lock:
            wait = self.retry_after()
            if wait > 0:
                from fastapi import HTTPException

                raise HTTPException(status_code=429, headers={"Retry-After": str(math.ceil(wait))},
                                    detail=f"too many failed logins: try again in {math.ceil(wait)} s")
            self.checked += 1
            ok = hmac.compare_digest(username.encode(), self._user) & hmac.compare_digest(
                password.encode(), self._password)
            if ok:
                self._failures, self._locked_until = 0, 0.0
                return True
            self._failures += 1
            if self._failures >= FREE_TRIES:
                lock = min(MAX_LOCK_S, FIRST_LOCK_S * 2 ** (self._failures - FREE_TRIES))
                self._locked_until = self._clock() + lock
            return False

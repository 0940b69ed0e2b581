"""Who is signed in to the console, and what they may do: sessions, CSRF tokens, rate limits.

A session is a signed cookie, not a record kept by one process: `NAME.ROLE.EXPIRES.NONCE` and
an HMAC-SHA256 of it keyed by the secret of the token that signed in. Every worker and replica
configured with the same tokens checks it alike, nothing is stored, and removing a token from
the configuration ends its sessions at once (no secret left to check them with). The cookie
never holds the token.

The CSRF token of a session is an HMAC of its nonce, keyed the same way: each form carries it,
and an action whose form does not carry the session's is refused (403), whatever the cookie.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections import deque
from dataclasses import dataclass

from stepguard.proxy.ops.admin import AdminTokens

SESSION_COOKIE = "stepguard_console"
SIGNIN_COOKIE = "stepguard_console_signin"     # the sign-in form's own CSRF token
SESSION_S = 8 * 3600        # a session lasts this long from sign-in, then sign in again
OPERATOR, VIEWER = "operator", "viewer"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the request is from: a token's name and role, or `anonymous` on an open console."""

    name: str
    role: str
    nonce: str = ""
    expires: float = 0.0
    key: bytes = b""         # the signing token's secret: the CSRF token is keyed by it

    @property
    def acts(self) -> bool:
        return self.role == OPERATOR

    @property
    def csrf(self) -> str:
        if not self.key:
            return ""
        return _mac(self.key, f"csrf.{self.nonce}")

    def csrf_ok(self, given: str | None) -> bool:
        expected = self.csrf
        return bool(expected) and given is not None and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), expected.encode())


def _mac(key: bytes, text: str) -> str:
    digest = hmac.new(key, text.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()


class Sessions:
    """Sign-in by token, and the session cookie's making and checking."""

    def __init__(self, tokens: AdminTokens, session_s: float = SESSION_S) -> None:
        self.tokens = tokens
        self.session_s = session_s

    def _entries(self) -> list[tuple[str, str, bytes]]:
        return ([(name, OPERATOR, secret) for name, secret in self.tokens.tokens]
                + [(name, VIEWER, secret) for name, secret in self.tokens.viewers])

    def sign_in(self, token: str) -> Identity | None:
        """The identity a token pasted into the sign-in form is, else None. Every token is
        compared, in constant time."""
        offered = token.strip().encode("utf-8", "surrogateescape")
        found = None
        for name, role, secret in self._entries():
            if hmac.compare_digest(offered, secret) and found is None:
                found = Identity(name, role, secrets.token_urlsafe(18),
                                 time.time() + self.session_s, secret)
        return found

    def cookie(self, identity: Identity) -> str:
        body = f"{_b64(identity.name)}.{identity.role}.{int(identity.expires)}.{identity.nonce}"
        return f"{body}.{_mac(identity.key, 'session.' + body)}"

    def check(self, cookie: str | None) -> Identity | None:
        """The identity a session cookie proves, if it is whole, signed by a token still
        configured with that name and role, and not expired."""
        if not cookie:
            return None
        parts = cookie.split(".")
        if len(parts) != 5:
            return None
        encoded, role, expires, nonce, mac = parts
        try:
            name, until = _unb64(encoded), int(expires)
        except (ValueError, UnicodeDecodeError):
            return None
        if until < time.time():
            return None
        body = ".".join(parts[:4])
        found = None
        for entry_name, entry_role, secret in self._entries():
            if entry_name == name and entry_role == role and hmac.compare_digest(
                    mac.encode(), _mac(secret, "session." + body).encode()) and found is None:
                found = Identity(name, role, nonce, until, secret)
        return found


class Window:
    """At most `limit` events per `seconds` for each key (a session, a client address), with at
    most `keys` keys tracked (the oldest forgotten first): memory stays bounded whoever asks."""

    def __init__(self, limit: int, seconds: float, keys: int = 4096) -> None:
        self.limit, self.seconds, self.keys = limit, seconds, keys
        self.seen: dict[str, deque[float]] = {}

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        times = self.seen.pop(key, None) or deque()
        while times and times[0] <= now - self.seconds:
            times.popleft()
        allowed = len(times) < self.limit
        if allowed:
            times.append(now)
        self.seen[key] = times           # re-inserted: the most recent key is last
        while len(self.seen) > self.keys:
            del self.seen[next(iter(self.seen))]
        return allowed

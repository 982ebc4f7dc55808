"""Who may use the console, and what every response says to the browser.

* **Token.** Bound to a loopback address the console may run without one; bound to
  any other address it refuses to start without ``KAFKA_IDEM_CONSOLE_TOKEN``. With a
  token, every request but the login page, ``/static`` and ``/healthz`` carries it:
  ``Authorization: Bearer TOKEN`` (scripts), or the session cookie the login form
  sets (browsers), signed with a key made at start (a restart logs everyone out).
  Tokens and signatures are compared in constant time.
* **Host.** Without a token only a loopback ``Host`` header is served (``localhost``
  or a loopback IP literal), so a web page whose name an attacker points at 127.0.0.1
  (DNS rebinding) reads nothing.
* **CSRF.** Every state-changing request is a POST whose form carries a token bound to
  a random cookie of the browser (``SameSite=Strict``); a POST without it, or with
  another browser's, is refused (403), as is one whose ``Origin`` is another site. A
  script's POST with the bearer token needs none (a browser never sends that header
  by itself). Nothing changes state on a GET. ``--read-only`` refuses every POST but
  the login and the logout. A logout revokes its session.
* **Headers.** A Content-Security-Policy that allows the console's own script and
  style files only (no inline script, no other origin), ``X-Frame-Options: DENY``,
  ``nosniff``, a referrer for its own pages only (``same-origin``: a browser then sends
  the console's own ``Origin`` with a form, where ``no-referrer`` makes it ``null``,
  which is refused as another site's), and ``Cache-Control: no-store`` on every page
  with data;
  ``Server-Timing: app;dur=MS`` gives the server time of each response.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp

SESSION_COOKIE = "kafka_idem_session"  # + "_<port>": consoles on one host keep their own
CSRF_COOKIE = "kafka_idem_csrf"
CSRF_FIELD = "csrf"
SESSION_SECONDS = 12 * 3600
OPEN_PATHS = ("/static/", "/healthz", "/login", "/favicon.ico")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an address, or a ``Host`` header's name without its port) is
    loopback: ``localhost``, or an IP literal in 127.0.0.0/8 or ``::1`` — never a name
    that merely starts like one (``127.0.0.1.evil.example``)."""
    name = addr.strip().lower()
    if name == "localhost":
        return True
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without its port (``[::1]:8088`` -> ``[::1]``)."""
    name, colon, port = header.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or (
            name.count(":") and not name.startswith("[")):
        return header  # no port (or an IPv6 literal without brackets, or a bad one)
    return name


@dataclass
class Guard:
    """The console's security settings and the key its cookies are signed with."""

    token: str | None
    read_only: bool
    actor: str  # who acts when no one logged in (loopback without a token)
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    revoked: set[str] = field(default_factory=set)  # sessions logged out (until a restart)
    port: int = 8088

    @property
    def session_name(self) -> str:
        return cookie_names(self.port)[0]

    @property
    def csrf_name(self) -> str:
        return cookie_names(self.port)[1]

    # --- sessions ------------------------------------------------------------------
    def check_token(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), self.token.encode("utf-8"))

    def _sign(self, text: str) -> str:
        return hmac.new(self.key, text.encode("utf-8"), hashlib.sha256).hexdigest()

    def session_cookie(self, operator: str) -> str:
        name = base64.urlsafe_b64encode(operator.encode("utf-8")).decode("ascii")
        body = f"{name}.{int(time.time()) + SESSION_SECONDS}"
        return f"{body}.{self._sign(body)}"

    def session_operator(self, cookie: str | None) -> str | None:
        """The operator a valid, unexpired session cookie names (else ``None``)."""
        if not cookie or cookie.count(".") != 2 or cookie in self.revoked:
            return None
        name, expires, sig = cookie.split(".")
        if not hmac.compare_digest(sig, self._sign(f"{name}.{expires}")):
            return None
        try:
            if int(expires) < time.time():
                return None
            return base64.urlsafe_b64decode(name.encode("ascii")).decode("utf-8")
        except ValueError:
            return None

    # --- CSRF ------------------------------------------------------------------------
    def csrf_token(self, cookie: str) -> str:
        return self._sign(f"csrf:{cookie}")

    def csrf_ok(self, cookie: str | None, given: str | None) -> bool:
        return bool(cookie and given) and hmac.compare_digest(
            self.csrf_token(cookie or ""), given or "")


def cookie_names(port: int) -> tuple[str, str]:
    """The session and CSRF cookies of the console on ``port`` (a browser sends a host's
    cookies to every port of it: two consoles must not read each other's)."""
    return f"{SESSION_COOKIE}_{port}", f"{CSRF_COOKIE}_{port}"


def clean_operator(name: str) -> str:
    """An operator name fit for the audit trail: printable, at most 64 characters."""
    text = "".join(ch for ch in name if ch.isprintable()).strip()
    return text[:64]


class GuardMiddleware(BaseHTTPMiddleware):
    """Applies :class:`Guard` to every request (module doc)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        super().__init__(app)
        self.guard = guard

    async def dispatch(self, request: Request,
                       call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        response = await self._checked(request, call_next)
        took = (time.perf_counter() - started) * 1000
        response.headers["Server-Timing"] = f"app;dur={took:.1f}"
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        if not request.url.path.startswith("/static/"):
            response.headers["Cache-Control"] = "no-store"
        if not request.cookies.get(self.guard.csrf_name):
            response.set_cookie(self.guard.csrf_name, request.state.csrf_cookie, httponly=True,
                                samesite="strict", path="/")
        return response

    async def _checked(self, request: Request,
                       call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        guard = self.guard
        path = request.url.path
        request.state.csrf_cookie = (request.cookies.get(self.guard.csrf_name)
                                     or secrets.token_hex(16))
        request.state.csrf = guard.csrf_token(request.state.csrf_cookie)
        request.state.operator = guard.actor
        if guard.token is None:
            if not is_loopback(host_name(request.headers.get("host") or "")):
                return PlainTextResponse("refused: this console serves loopback host names "
                                         "only (it has no token)", status_code=403)
        elif path.startswith(OPEN_PATHS):
            request.state.operator = guard.session_operator(
                request.cookies.get(guard.session_name))  # None: nobody logged in yet
        else:
            operator, by_bearer = self._authenticated(request)
            if operator is None:
                if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                    return RedirectResponse(f"/login?next={quote(_local(request))}",
                                            status_code=303)
                return PlainTextResponse("unauthorized: log in, or send Authorization: "
                                         "Bearer TOKEN", status_code=401,
                                         headers={"WWW-Authenticate": "Bearer"})
            request.state.operator = operator
            request.state.bearer = by_bearer
        if request.method not in ("GET", "HEAD"):
            if request.method != "POST":
                return PlainTextResponse("method not allowed", status_code=405)
            origin = request.headers.get("origin")
            if origin and (origin == "null" or urlsplit(origin).netloc != request.headers.get(
                    "host")):
                return PlainTextResponse("refused: a request from another site",
                                         status_code=403)
            if guard.read_only and path not in ("/login", "/logout"):
                return PlainTextResponse("refused: this console is read-only", status_code=403)
            form = await request.form()
            request.state.form = form  # the endpoint's (it cannot read the body again)
            given = form.get(CSRF_FIELD)
            # A script's bearer token is no cookie a browser sends by itself: no CSRF.
            token = given if isinstance(given, str) else None
            if not getattr(request.state, "bearer", False) and not guard.csrf_ok(
                    request.cookies.get(guard.csrf_name), token):
                return PlainTextResponse("refused: missing or wrong CSRF token (reload the "
                                         "page and submit again)", status_code=403)
        return await call_next(request)

    def _authenticated(self, request: Request) -> tuple[str | None, bool]:
        """Who the request is from (None: nobody known), and whether by a bearer token."""
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and self.guard.check_token(header[7:].strip()):
            return self.guard.actor, True
        cookie = request.cookies.get(self.guard.session_name)
        return self.guard.session_operator(cookie), False


def _local(request: Request) -> str:
    """The request's path and query, to come back to after logging in."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def safe_next(target: str | None) -> str:
    """A path on this site to go to after the login (never another site)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target

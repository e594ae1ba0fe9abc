"""Who may use the studio, and from where: a token on every request (as Jupyter does), CSRF
protection on every call that changes something, and headers that keep pages from being framed or
from loading anything but the studio's own files.

The token is accepted once as `?token=` (then kept in an HttpOnly, SameSite=Strict cookie and
dropped from the address bar), as `Authorization: Bearer TOKEN` from API clients, or typed into
the login page. A browser's POST, PUT and DELETE must carry the per-session CSRF token (a cookie
the page's script copies into the `X-CSRF-Token` header: double submit); a Bearer request carries
no ambient credential, so it needs none.
"""

from __future__ import annotations

import hmac
import json
import secrets
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlencode

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
OPEN_PATHS = ("/static/", "/login", "/favicon.ico")  # what a browser needs before it has the token
HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",  # a URL with ?token= never leaks to another site
}


def cookie_names(scope: Scope) -> tuple[str, str]:
    """The token and CSRF cookies, per port: two studios on one machine keep their own."""
    port = (scope.get("server") or ("", 0))[1] or 0
    return f"llmopt_studio_{port}", f"llmopt_csrf_{port}"


def same(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class Guard:
    """ASGI middleware in front of every route."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        token_cookie, csrf_cookie = cookie_names(scope)
        csrf = request.cookies.get(csrf_cookie) or secrets.token_urlsafe(24)
        scope.setdefault("state", {})["csrf"] = csrf
        new_cookies = [] if csrf_cookie in request.cookies else [(csrf_cookie, csrf, False)]
        bearer = request.headers.get("authorization", "")
        by_bearer = bearer.startswith("Bearer ") and same(bearer.removeprefix("Bearer ").strip(), self.token)
        by_cookie = same(request.cookies.get(token_cookie), self.token)
        given = request.query_params.get("token")

        if given is not None and request.method in SAFE_METHODS and not same(given, self.token):
            respond = _problem(401, "wrong token in the address", "open the URL the studio printed when it started")
        elif given is not None and request.method in SAFE_METHODS:
            query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
            respond = _redirect(request.url.path + (f"?{query}" if query else ""), [(token_cookie, self.token, True)])
        elif any(scope["path"].startswith(p) for p in OPEN_PATHS):
            respond = self.app
        elif not (by_bearer or by_cookie):
            if request.method in SAFE_METHODS and not scope["path"].startswith("/api/") and "text/html" in request.headers.get("accept", ""):
                respond = _redirect("/login?" + urlencode({"next": _relative(request)}), [])
            else:
                respond = _problem(401, "this studio asks for its token",
                                   "open the URL it printed (with ?token=...), or send Authorization: Bearer TOKEN")
        elif request.method not in SAFE_METHODS and not by_bearer and not same(request.headers.get(CSRF_HEADER), csrf):
            respond = _problem(403, "this request has no valid CSRF token",
                               "reload the page and try again (API clients: send Authorization: Bearer TOKEN)")
        else:
            respond = self.app
        await respond(scope, receive, _with_headers(send, new_cookies))


def _relative(request: Request) -> str:
    return request.url.path + (f"?{request.url.query}" if request.url.query else "")


def _cookie_header(name: str, value: str, http_only: bool) -> str:
    cookie: SimpleCookie = SimpleCookie()
    cookie[name] = value
    cookie[name]["path"] = "/"
    cookie[name]["samesite"] = "Strict"
    if http_only:
        cookie[name]["httponly"] = True
    return cookie.output(header="").strip()


def _with_headers(send: Send, cookies: list[tuple[str, str, bool]]) -> Send:
    """Security headers on every response, and the cookies this request set."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            for name, value in HEADERS.items():
                headers.setdefault(name, value)
            for cookie in cookies:
                headers.append("set-cookie", _cookie_header(*cookie))
        await send(message)

    return wrapped


def _redirect(location: str, cookies: list[tuple[str, str, bool]]) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"location", location.encode()), (b"content-length", b"0")]
        headers += [(b"set-cookie", _cookie_header(*c).encode()) for c in cookies]
        await send({"type": "http.response.start", "status": 303, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    return app


def _problem(status: int, error: str, fix: str) -> ASGIApp:
    payload: dict[str, Any] = {"error": error, "fix": fix}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        data = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def login_target(next_path: str | None) -> str:
    """Where to go after logging in: a path on this studio, never another site."""
    if not next_path or not next_path.startswith("/") or next_path.startswith("//") or "\\" in next_path:
        return "/"
    return next_path

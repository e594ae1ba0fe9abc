"""The studio's application: every page and `/api/` route behind the token guard, the error
mapping, the vendored static files, and `serve`, which the `llmopt studio` command calls."""

from __future__ import annotations

import secrets
import sys

import uvicorn
from fastapi import FastAPI, Form, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from llmopt import __version__
from llmopt.engine import vllm
from llmopt.errors import LlmoptError
from llmopt.studio import chat, endpoints, evaluations, hardware, jobs, models, recipes, recommendations
from llmopt.studio.live import Feeds
from llmopt.studio.problems import as_problem, body, json_error, status_of
from llmopt.studio.rendering import STATIC, page
from llmopt.studio.security import Guard, cookie_names, login_target, same
from llmopt.studio.tasks import Tasks

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
AREAS = (models, recipes, jobs, endpoints, chat, evaluations, recommendations, hardware)


def create_app(token: str) -> FastAPI:
    """The studio, asking every request for `token`."""
    if not token:
        raise LlmoptError("the studio needs a token", "pass one, or let `serve` make one")
    app = FastAPI(title="llmopt studio", version=__version__, docs_url=None, redoc_url=None,  # the docs UI loads a CDN
                  description="The JSON API the studio's pages use. Send `Authorization: Bearer TOKEN`. Errors are "
                              "`{\"error\": ..., \"fix\": ...}`: 400 for bad input, 404 for an unknown name.")
    app.state.tasks, app.state.feeds, app.state.meters = Tasks(), Feeds(), {}
    for area in AREAS:
        app.include_router(area.api, prefix="/api")
        if hasattr(area, "pages"):
            app.include_router(area.pages)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_entry_pages(app, token)
    _add_error_pages(app)
    app.add_middleware(Guard, token=token)
    return app


def _add_entry_pages(app: FastAPI, token: str) -> None:
    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/models", status_code=303)

    @app.get("/login", include_in_schema=False, response_class=HTMLResponse)
    def login_page(request: Request, next: str = "/") -> HTMLResponse:
        return page(request, "login.html", next=login_target(next), wrong=False)

    @app.post("/login", include_in_schema=False, response_model=None)
    def login(request: Request, token_given: str = Form("", alias="token"), next: str = Form("/")) -> Response:
        if not same(token_given, token):
            return page(request, "login.html", status_code=401, next=login_target(next), wrong=True)
        response = RedirectResponse(login_target(next), status_code=303)
        response.set_cookie(cookie_names(request.scope)[0], token, httponly=True, samesite="strict", path="/")
        return response


def _add_error_pages(app: FastAPI) -> None:
    """JSON for the API, a page for a person; the SDK's words either way."""

    def wants_page(request: Request) -> bool:
        return not request.url.path.startswith("/api/") and request.method == "GET"

    def problem(request: Request, exc: Exception) -> Response:
        if not wants_page(request):
            return json_error(request, exc)
        found = as_problem(exc)
        return page(request, "problem.html", status_code=status_of(found), **body(found))

    def missing(request: Request, exc: HTTPException) -> Response:
        if not wants_page(request):
            return JSONResponse({"error": str(exc.detail), "fix": "see /openapi.json"}, status_code=exc.status_code)
        return page(request, "problem.html", status_code=exc.status_code, error=str(exc.detail), fix="use the navigation bar")

    for kind in (LlmoptError, RequestValidationError, ValidationError):
        app.add_exception_handler(kind, problem)
    app.add_exception_handler(HTTPException, missing)  # type: ignore[arg-type]


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, token: str | None = None, insecure: bool = False) -> None:
    """Run the studio until interrupted, printing its address with the token.

    It binds loopback by default. Another address serves it to whoever can reach it, so it needs a
    token of the user's own (`token`), or `insecure` to say the network is theirs alone; without
    a token of theirs, one is made for this run."""
    vllm.check_address(host, port)
    if not vllm.is_loopback(host) and not token and not insecure:
        raise LlmoptError(f"binding {host} would serve the studio to anyone who can reach it",
                          "pass a token of your own (--token, or LLMOPT_STUDIO_TOKEN), or --insecure if the network is yours alone")
    vllm.check_port_free(host, port)
    token = token or secrets.token_urlsafe(32)
    shown = f"[{host}]" if ":" in host else host
    print(f"llmopt studio: http://{shown}:{port}/?token={token}", file=sys.stderr, flush=True)
    uvicorn.run(create_app(token), host=host, port=port, log_level="warning", timeout_graceful_shutdown=3)


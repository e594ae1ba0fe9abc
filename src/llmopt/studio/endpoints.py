"""Endpoints: deploying (in the background: `sdk.deploy` returns only once the endpoint answers),
listing, stopping, logs, and the live metrics an endpoint's engine publishes."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from llmopt import names, sdk
from llmopt.errors import LlmoptError
from llmopt.studio import prometheus, streams
from llmopt.studio.problems import ERRORS, Upstream, lookup
from llmopt.studio.rendering import fragment, page

api = APIRouter(tags=["endpoints"], responses=ERRORS)
pages = APIRouter(include_in_schema=False)
SCRAPE_TIMEOUT_S = 5.0


class Deploy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="An artifact folder, an imported model, a catalogue id, a Hugging Face "
                                                 "folder or a .gguf file (the last three are imported on first use).")
    name: str | None = Field(None, description="Endpoint name (default: generated).")
    port: int | None = Field(None, ge=1, le=65535, description="Port (default: a free one). The studio deploys on loopback only.")
    max_model_len: int | None = Field(None, gt=0, description="Longest prompt plus output (models only).")
    kv_cache_gib: int | None = Field(None, gt=0, description="KV cache GiB on CPU (models only).")
    api_key: str | None = Field(None, description="Require this key on every route of the endpoint.")


def default_name(model: str) -> str:
    return f"{names.slug(Path(model).name, 'endpoint')[:40]}-{secrets.token_hex(3)}"


def start_deploy(request: Request, body: Deploy) -> dict[str, Any]:
    """Start a deploy in the background; the SDK's refusals of the input come back at once."""
    overrides = {k: v for k, v in {"max_model_len": body.max_model_len, "kv_cache_gib": body.kv_cache_gib}.items() if v is not None}
    engine = sdk.engine_config(**overrides) if overrides else None
    name = body.name or default_name(body.model)
    task = request.app.state.tasks.start(
        "deploy", f"{body.model} as {name}",
        lambda task: sdk.deploy(body.model, name=name, port=body.port, engine=engine, api_key=body.api_key).to_dict())
    return {"task": task.summary(), "endpoint": name}


def readings(app: Any, endpoint: Any) -> list[prometheus.Reading]:
    """The endpoint's metrics now, with counter rates since the studio last read them."""
    name = endpoint.name
    if endpoint.status != "READY":
        raise LlmoptError(f"endpoint '{name}' is {endpoint.status}", "metrics come from a READY endpoint")
    try:
        response = httpx.get(f"{endpoint.url}/metrics", headers=endpoint.headers, timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise Upstream(f"endpoint '{name}' did not answer for its metrics ({type(exc).__name__})", "see its log") from None
    if response.status_code != 200:
        raise Upstream(f"endpoint '{name}' answered {response.status_code} for its metrics", "see its log")
    return app.state.meters.setdefault(name, prometheus.Meter()).read(response.text)


def observe(app: Any, name: str) -> dict[str, Any]:
    """What the endpoint's live page shows: its record and its metrics, read together once a second."""
    endpoint = sdk.get_endpoint(name)
    try:
        return {"endpoint": endpoint, "readings": readings(app, endpoint), "problem": None}
    except LlmoptError as exc:
        return {"endpoint": endpoint, "readings": [], "problem": exc}


@api.get("/endpoints", summary="Endpoints, newest last")
def list_endpoints(status: str | None = None) -> list[dict[str, Any]]:
    return [e.to_dict() for e in sdk.list_endpoints(status)]


@api.post("/endpoints", status_code=202, summary="Deploy a model or an artifact, in the background")
def deploy(request: Request, body: Deploy) -> dict[str, Any]:
    return start_deploy(request, body)


@api.get("/endpoints/{name}", summary="An endpoint")
def get_endpoint(name: str) -> dict[str, Any]:
    return lookup(sdk.get_endpoint, name).to_dict()


@api.post("/endpoints/{name}/stop", summary="Stop an endpoint")
def stop_endpoint(name: str) -> dict[str, Any]:
    lookup(sdk.get_endpoint, name)
    return sdk.stop_endpoint(name).to_dict()


@api.get("/endpoints/{name}/logs", summary="The last lines of an endpoint's log")
def endpoint_logs(name: str, tail: int = Query(200, ge=1, le=100_000)) -> dict[str, list[str]]:
    lookup(sdk.get_endpoint, name)
    return streams.tail(sdk.endpoint_logs(name), tail)


@api.get("/endpoints/{name}/metrics", summary="The endpoint's live metrics (counters with their rates)")
def endpoint_metrics(request: Request, name: str) -> list[dict[str, Any]]:
    return [r.__dict__ for r in readings(request.app, lookup(sdk.get_endpoint, name))]


@api.get("/tasks", summary="What this studio runs in the background (deploys, recommendations)")
def list_tasks(request: Request) -> list[dict[str, Any]]:
    return [t.summary() for t in request.app.state.tasks.list()]


@api.get("/tasks/{task_id}", summary="A background task")
def get_task(request: Request, task_id: str) -> dict[str, Any]:
    return request.app.state.tasks.get(task_id).summary()


def _table_context(app: Any) -> dict[str, Any]:
    return {"endpoints": list(reversed(sdk.list_endpoints())), "tasks": app.state.tasks.list()}


@pages.get("/endpoints", response_class=HTMLResponse)
def endpoints_page(request: Request, model: str | None = None) -> HTMLResponse:
    return page(request, "endpoints.html", **_table_context(request.app), models=sdk.list_models(),
                artifacts=[j for j in sdk.list_jobs("COMPLETED") if j.artifact], chosen=model)


@pages.get("/endpoints/live")
async def endpoints_live(request: Request) -> Any:
    app = request.app
    feed = app.state.feeds.get("endpoints", lambda: _table_context(app))
    return streams.record_page(feed, lambda context: {"table": fragment("_endpoints_table.html", **context)}, None,
                               lambda context: True)


@pages.get("/endpoints/{name}", response_class=HTMLResponse)
def endpoint_page(request: Request, name: str) -> HTMLResponse:
    return page(request, "endpoint.html", endpoint=lookup(sdk.get_endpoint, name))


@pages.get("/endpoints/{name}/live")
async def endpoint_live(request: Request, name: str) -> Any:
    endpoint = await run_in_threadpool(lookup, sdk.get_endpoint, name)
    app = request.app
    feed = app.state.feeds.get(("endpoint", name), lambda: observe(app, name))
    return streams.record_page(feed, lambda seen: {"status": fragment("_endpoint_status.html", **seen),
                                                   "metrics": fragment("_endpoint_metrics.html", **seen)},
                               Path(endpoint.log_path), lambda seen: seen["endpoint"].status in sdk.LIVE_ENDPOINT_STATUSES)

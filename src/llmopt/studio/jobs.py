"""Optimization jobs: the recipe builder that creates them, the list with each step's progress,
and a job's page (steps, live log, the artifact's measured metrics, and what to do next)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from llmopt import locations, recipe, sdk
from llmopt.errors import LlmoptError
from llmopt.studio import recipe_form, recipes, streams
from llmopt.studio.models import catalogue
from llmopt.studio.problems import ERRORS, NotFound, lookup
from llmopt.studio.rendering import PAGE_SIZE, fragment, page, paged

api = APIRouter(tags=["jobs"], responses=ERRORS)
pages = APIRouter(include_in_schema=False)


class CreateJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="An imported model, a catalogue id, a Hugging Face folder or a .gguf file.")
    recipe: dict[str, Any] | str = Field("baseline", description="A recipe (as the schema describes), or a built-in name.")
    name: str | None = Field(None, description="Job name (default: generated).")
    force: bool = Field(False, description="Rebuild even if an artifact with the same key exists.")


def manifest(record: Any) -> Any | None:
    """A completed job's artifact manifest, or None while it has none."""
    if record.status != "COMPLETED" or not record.artifact or not locations.exists(record.artifact):
        return None
    return locations.manifest(record.artifact)


def manifest_shown(record: Any) -> tuple[Any | None, str | None]:
    """The manifest for the job's page, or why it cannot be read (the page shows the job anyway)."""
    try:
        return manifest(record), None
    except LlmoptError as exc:
        return None, exc.one_line()


def recipe_yaml(record: Any) -> str:
    """The job's recipe as a person would write it (a record from an older llmopt may not parse)."""
    try:
        return recipes.described(recipe.parse(record.recipe)).yaml
    except LlmoptError as exc:
        return f"# {exc.one_line()}\n{yaml.safe_dump(record.recipe, sort_keys=False)}"


def signature(record: Any) -> tuple[Any, ...]:
    """What a job's row shows that can change."""
    return record.status, record.failure_reason, record.artifact, record.ended_at, json.dumps(
        {k: v.model_dump() for k, v in record.progress.items()}, sort_keys=True)


def active(record: Any) -> bool:
    return record.status in sdk.ACTIVE_JOB_STATUSES


@api.post("/jobs", status_code=201, summary="Create a job: run a recipe on a model in the background")
def create_job(body: CreateJob) -> dict[str, Any]:
    job = sdk.optimize(body.model, body.recipe, name=body.name, force=body.force, wait=False)
    return {"job": job.record.to_dict(), "warnings": job.warnings, "reused_from": job.reused_from}


@api.get("/jobs", summary="Jobs, oldest first")
def list_jobs(status: str | None = None, name_contains: str | None = None) -> list[dict[str, Any]]:
    return [j.to_dict() for j in sdk.list_jobs(status, name_contains)]


@api.get("/jobs/{name}", summary="A job")
def get_job(name: str) -> dict[str, Any]:
    return lookup(sdk.get_job, name).to_dict()


@api.post("/jobs/{name}/stop", summary="Stop a running job")
def stop_job(name: str) -> dict[str, Any]:
    lookup(sdk.get_job, name)
    return sdk.stop_job(name).to_dict()


@api.get("/jobs/{name}/logs", summary="The last lines of a job's log")
def job_logs(name: str, tail: int = Query(200, ge=1, le=100_000)) -> dict[str, list[str]]:
    lookup(sdk.get_job, name)
    return streams.tail(sdk.job_logs(name), tail)


@api.get("/jobs/{name}/manifest", summary="A completed job's artifact manifest")
def job_manifest(name: str) -> dict[str, Any]:
    record = lookup(sdk.get_job, name)
    found = manifest(record)
    if found is None:
        raise LlmoptError(f"job '{name}' is {record.status}: it has no artifact", "wait for it to complete")
    return found.model_dump(mode="json")


@api.get("/jobs/{name}/export-command", summary="The plain vLLM command that serves the job's artifact")
def export_command(name: str) -> dict[str, str]:
    record = lookup(sdk.get_job, name)
    if record.status != "COMPLETED" or not record.artifact:
        raise LlmoptError(f"job '{name}' is {record.status}: it has no artifact", "wait for it to complete")
    return {"command": sdk.export_command(record.artifact)}


@pages.get("/jobs", response_class=HTMLResponse)
def jobs_page(request: Request, status: str | None = None, q: str | None = None,
              offset: int = Query(0, ge=0), limit: int = Query(PAGE_SIZE, ge=1, le=100_000)) -> HTMLResponse:
    return page(request, "jobs.html", **_rows(status, q, offset, limit))


@pages.get("/jobs/rows", response_class=HTMLResponse)
def jobs_rows(request: Request, status: str | None = None, q: str | None = None,
              offset: int = Query(0, ge=0), limit: int = Query(PAGE_SIZE, ge=1, le=100_000)) -> HTMLResponse:
    return page(request, "_job_rows.html", **_rows(status, q, offset, limit))


def _rows(status: str | None, q: str | None, offset: int, limit: int) -> dict[str, Any]:
    return {**paged("jobs", sdk.list_jobs(status or None, q or None), offset, limit), "status": status or "", "q": q or "",
            "statuses": sdk.JOB_STATUSES}


@pages.get("/jobs/live")
async def jobs_live(request: Request) -> Any:
    feed = request.app.state.feeds.get("jobs", sdk.list_jobs)
    return streams.list_page(feed, "job", lambda j: j.name, signature, lambda j: fragment("_job_row.html", job=j))


@pages.get("/jobs/new", response_class=HTMLResponse)
def new_job_page(request: Request, model: str | None = None, base: str = "baseline") -> HTMLResponse:
    return page(request, "job_new.html", models=sdk.list_models(), catalogue=catalogue(), chosen=model or sdk.DEFAULT_MODEL,
                builtins=list(sdk.list_recipes()), base=base, **_form(base, None))


@pages.get("/jobs/new/form", response_class=HTMLResponse)
def new_job_form(request: Request, base: str = "baseline", recipe_json: str | None = Query(None, alias="recipe")) -> HTMLResponse:
    return page(request, "_recipe_form.html", **_form(base, recipe_json))


def _form(base: str, recipe_json: str | None) -> dict[str, Any]:
    """The builder's sections filled from a built-in recipe or a recipe dict (an uploaded file's)."""
    if recipe_json is not None:
        try:
            data = json.loads(recipe_json)
        except json.JSONDecodeError:
            raise LlmoptError("the recipe is not JSON", "upload the file again") from None
        chosen = recipe.parse(data, origin="uploaded recipe")
    else:
        builtins = sdk.list_recipes()
        if base not in builtins:
            raise NotFound(f"no built-in recipe named '{base}'", f"use one of {', '.join(builtins)}, or upload a recipe file")
        chosen = builtins[base]
    return {"sections": recipe_form.sections(sdk.recipe_schema(), chosen.to_dict()), "recipe_name": chosen.name or ""}


@pages.get("/jobs/{name}", response_class=HTMLResponse)
def job_page(request: Request, name: str) -> HTMLResponse:
    record = lookup(sdk.get_job, name)
    found, unreadable = manifest_shown(record)
    return page(request, "job.html", job=record, recipe_yaml=recipe_yaml(record), manifest=found, manifest_problem=unreadable)


@pages.get("/jobs/{name}/live")
async def job_live(request: Request, name: str) -> Any:
    record = await run_in_threadpool(lookup, sdk.get_job, name)
    feed = request.app.state.feeds.get(("job", name), lambda: sdk.get_job(name))
    return streams.record_page(feed, _job_fragments, Path(record.log_path), active)


def _job_fragments(record: Any) -> dict[str, str]:
    return {"summary": fragment("_job_summary.html", job=record), "steps": fragment("_job_steps.html", job=record)}

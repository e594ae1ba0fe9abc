"""Evaluations: started in the background (each in a worker process of its own), listed with
their live progress, and read as the report reads them: the metric table per level, the charts,
the ratio table; and several overlaid on one page."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request, UploadFile
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from llmopt import names, paths, sdk
from llmopt.errors import LlmoptError
from llmopt.evaluation.results import EvaluationResults
from llmopt.presentation import comparison, report
from llmopt.studio import hardware_file, streams
from llmopt.studio.problems import ERRORS, NotFound, lookup
from llmopt.studio.rendering import PAGE_SIZE, fragment, page, paged

api = APIRouter(tags=["evaluations"], responses=ERRORS)
pages = APIRouter(include_in_schema=False)
DATASETS = ("builtin-qa", "builtin-coding", "sharegpt")
MAX_UPLOAD_BYTES = 256 << 20


class CreateEvaluation(BaseModel):
    """What `llmopt.evaluate` takes, less the files it would write outside the llmopt home."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(None, description="A running llmopt endpoint.")
    url: str | None = Field(None, description="Any OpenAI-compatible server.")
    model: str | None = Field(None, description="A model or artifact, deployed for the run.")
    compare: list[str] | None = Field(None, description="Models or artifacts to compare, deployed in turn (the first is the reference).")
    dataset: str = Field("builtin-qa", description="builtin-qa, builtin-coding, sharegpt, synthetic:IN,OUT, or an uploaded JSONL.")
    concurrency: list[int] = Field([1, 4], min_length=1, max_length=64)
    requests: int | None = Field(16, description="Requests per level, the same prompts at every level (at least 4 per user of the highest).")
    duration_s: float | None = Field(None, description="Seconds per level instead of a request count.")
    min_duration_s: float = Field(30.0, description="With a request count, seconds each level runs at least.")
    hardware: str | None = Field(None, description="A hardware price profile (see /api/hardware).")
    price_per_hour: float | None = Field(None, gt=0, le=1e6, description="An hourly price instead of a profile's.")
    discount: float | None = Field(None, ge=0, lt=1, description="A discount on the hourly price, 0-1.")
    quality: bool = Field(True, description="Also measure perplexity and greedy outputs.")
    tokenizer: str | None = Field(None, description="Tokenizer folder (for a URL target).")
    ttft_target_ms: float | None = Field(None, description="Goodput target for time to first token.")
    itl_target_ms: float | None = Field(None, description="Goodput target for time per output token.")
    timeout_s: float = Field(300.0, description="Per-request timeout.")
    seed: int = Field(0, description="Workload sampling seed.")
    api_key: str | None = Field(None, description="Key for a URL server that asks for one.")
    name: str | None = Field(None, description="Name of the evaluation (default: generated).")


def results_of(record: Any) -> EvaluationResults | None:
    """An evaluation's results so far, or None before its first level ends."""
    return sdk.evaluation_results(record.name) if record.results_file.is_file() else None


def drawn(results: EvaluationResults | None) -> dict[str, Any]:
    """What the results section shows, drawn by the report's own code."""
    if results is None:
        return {"results": None}
    head, rows = comparison.table(results.comparison) if results.comparison else ([], [])
    return {"results": results, "level_charts": report.level_charts(results.targets),
            "distribution_charts": report.distribution_charts(results.targets),
            "level_tables": [(t, report.level_table(t)) for t in results.targets],
            "comparison_head": head, "comparison_rows": rows, "comparison_note": comparison.NOTE}


def signature(record: Any) -> tuple[Any, ...]:
    return record.status, record.failure_reason, record.progress.model_dump_json()


def active(record: Any) -> bool:
    return record.status in sdk.ACTIVE_EVALUATION_STATUSES


@api.post("/evaluations", status_code=201, summary="Start an evaluation in the background")
def create_evaluation(body: CreateEvaluation) -> dict[str, Any]:
    record = sdk.evaluate(**body.model_dump(), background=True)
    return record.to_dict()


@api.get("/evaluations", summary="Evaluations, oldest first")
def list_evaluations(status: str | None = None) -> list[dict[str, Any]]:
    return [e.to_dict() for e in sdk.list_evaluations(status)]


@api.get("/evaluations/{name}", summary="An evaluation's record: status, progress, arguments")
def get_evaluation(name: str) -> dict[str, Any]:
    return lookup(sdk.get_evaluation, name).to_dict()


@api.get("/evaluations/{name}/results", summary="An evaluation's results (as far as it got, while it runs)")
def evaluation_results(name: str) -> dict[str, Any]:
    lookup(sdk.get_evaluation, name)
    return lookup(sdk.evaluation_results, name).model_dump(mode="json")


@api.post("/evaluations/{name}/stop", summary="Stop a running evaluation")
def stop_evaluation(name: str) -> dict[str, Any]:
    lookup(sdk.get_evaluation, name)
    return sdk.stop_evaluation(name).to_dict()


@api.get("/evaluations/{name}/logs", summary="The last lines of an evaluation's log")
def evaluation_logs(name: str, tail: int = Query(200, ge=1, le=100_000)) -> dict[str, list[str]]:
    lookup(sdk.get_evaluation, name)
    return streams.tail(sdk.evaluation_logs(name), tail)


@api.post("/datasets", status_code=201, summary="Upload a JSONL dataset for evaluations; returns its dataset spec")
def upload_dataset(file: UploadFile) -> dict[str, str]:
    """Kept in the llmopt home under a name the studio makes; `evaluate` reads it as any JSONL."""
    folder = paths.home() / "uploads"
    folder.mkdir(mode=0o700, exist_ok=True)
    stem = names.slug(Path(file.filename or "dataset").stem, "dataset")[:40]
    path = folder / f"{stem}-{secrets.token_hex(4)}.jsonl"
    data = file.file.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise LlmoptError(f"'{file.filename}' is larger than {MAX_UPLOAD_BYTES >> 20} MB", "upload a smaller sample of it")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)
    return {"dataset": str(path)}


@pages.get("/evaluations", response_class=HTMLResponse)
def evaluations_page(request: Request, offset: int = Query(0, ge=0), limit: int = Query(PAGE_SIZE, ge=1, le=100_000)) -> HTMLResponse:
    return page(request, "evaluations.html", **paged("evaluations", sdk.list_evaluations(), offset, limit))


@pages.get("/evaluations/rows", response_class=HTMLResponse)
def evaluations_rows(request: Request, offset: int = Query(0, ge=0), limit: int = Query(PAGE_SIZE, ge=1, le=100_000)) -> HTMLResponse:
    return page(request, "_evaluation_rows.html", **paged("evaluations", sdk.list_evaluations(), offset, limit))


@pages.get("/evaluations/live")
async def evaluations_live(request: Request) -> Any:
    feed = request.app.state.feeds.get("evaluations", sdk.list_evaluations)
    return streams.list_page(feed, "evaluation", lambda e: e.name, signature,
                             lambda e: fragment("_evaluation_row.html", evaluation=e))


@pages.get("/evaluations/new", response_class=HTMLResponse)
def new_evaluation_page(request: Request, model: str | None = None, endpoint: str | None = None,
                        compare: list[str] = Query([])) -> HTMLResponse:
    return page(request, "evaluation_new.html", models=sdk.list_models(), endpoints=sdk.list_endpoints("READY"),
                artifacts=[j for j in sdk.list_jobs("COMPLETED") if j.artifact], profiles=hardware_file.profiles(),
                datasets=DATASETS, model=model, endpoint=endpoint, compare=compare)


@pages.get("/evaluations/compare", response_class=HTMLResponse)
def compare_page(request: Request, name: list[str] = Query([], description="Two or more evaluations")) -> HTMLResponse:
    if len(set(name)) < 2:
        raise LlmoptError("pick two or more evaluations to compare", "tick them on the Evaluations page")
    targets = []
    for evaluation in dict.fromkeys(name):
        found = results_of(lookup(sdk.get_evaluation, evaluation))
        if found is None:
            raise NotFound(f"evaluation '{evaluation}' has no results yet", "wait for its first level to finish")
        targets += [t.model_copy(update={"label": f"{evaluation}: {t.label}"}) for t in found.targets]
    return page(request, "evaluation_compare.html", names=list(dict.fromkeys(name)), targets=targets,
                level_charts=report.level_charts(targets), distribution_charts=report.distribution_charts(targets))


@pages.get("/evaluations/{name}", response_class=HTMLResponse)
def evaluation_page(request: Request, name: str) -> HTMLResponse:
    record = lookup(sdk.get_evaluation, name)
    return page(request, "evaluation.html", evaluation=record, **drawn(results_of(record)))


@pages.get("/evaluations/{name}/live")
async def evaluation_live(request: Request, name: str) -> Any:
    record = await run_in_threadpool(lookup, sdk.get_evaluation, name)
    feed = request.app.state.feeds.get(("evaluation", name), lambda: sdk.get_evaluation(name))
    drawn_for: dict[str, Any] = {}

    def fragments(current: Any) -> dict[str, str]:
        """The results are read again only when the worker has written more of them."""
        stamp = current.results_file.stat().st_mtime if current.results_file.is_file() else None
        if drawn_for.get("stamp", -1) != stamp:
            drawn_for.update(stamp=stamp, html=fragment("_evaluation_results.html", **drawn(results_of(current))))
        return {"summary": fragment("_evaluation_summary.html", evaluation=current), "results": drawn_for["html"]}

    return streams.record_page(feed, fragments, Path(record.log_path), active)

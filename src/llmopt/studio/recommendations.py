"""Recommendations: `sdk.recommend` runs in a studio thread (it blocks until every candidate is
measured), its events kept as the task's progress; the page shows the candidates, the ranked rows
as candidates finish, the Pareto charts, and a Deploy button on every measured row."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse

from llmopt import sdk
from llmopt.presentation import recommendation as presented
from llmopt.studio.live import POLL_S
from llmopt.studio.problems import ERRORS
from llmopt.studio.rendering import fragment, page
from llmopt.studio.tasks import Task

api = APIRouter(tags=["recommendations"], responses=ERRORS)
pages = APIRouter(include_in_schema=False)
KIND = "recommendation"
ACCEPT_WAIT_S = 15.0  # the SDK checks the arguments and plans the candidates (importing the model on first use)


class CreateRecommendation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="An imported model or a catalogue id.")
    goal: str = Field("balanced", description="latency, throughput, cost or balanced.")
    slos: list[str] = Field([], description="Service-level targets, e.g. ttft_p90_ms=800.")
    max_quality_loss: float | None = Field(None, description="Largest perplexity increase allowed, as a fraction.")
    dataset: str = Field("builtin-qa", description="builtin-qa, builtin-coding, sharegpt, synthetic:IN,OUT or a JSONL path.")
    concurrency: list[int] = Field([1, 2, 4, 8], min_length=1, max_length=64)
    requests: int = Field(8, description="Requests per level (at least 4 per user of the highest level; every level sends the same).")
    min_duration_s: float = Field(10.0, description="Seconds each level runs at least.")
    budget_minutes: float | None = Field(None, description="Drop the most expensive candidates to fit this budget.")


def _work(body: CreateRecommendation) -> Any:
    def work(task: Task) -> Any:
        def events(kind: str, **data: Any) -> None:
            if kind == "estimates":
                task.report(recommendation=data["recommendation"], stage="planned")
                task.accepted.set()
            elif kind == "candidate":
                task.report(stage=f"candidate {data['name']} (about {data['estimate_s'] / 60:.0f} min)", done=0, total=None)
            elif kind == "deploying":
                task.report(stage=f"deploying {data['target']}")
            elif kind == "level":
                task.report(stage=f"{data['target']} @ concurrency {data['concurrency']}", done=0, total=data.get("total"))
            elif kind == "request":
                task.report(done=task.state.get("done", 0) + 1)

        found = sdk.recommend(body.model, goal=body.goal, slos=body.slos, max_quality_loss=body.max_quality_loss,
                              dataset=body.dataset, concurrency=body.concurrency, requests=body.requests,
                              min_duration_s=body.min_duration_s, budget_minutes=body.budget_minutes, events=events)
        task.report(recommendation=found, stage="done")
        return found

    return work


def described(task: Task) -> dict[str, Any]:
    rec = task.state.get("recommendation")
    return {**task.summary(), "recommendation": rec.model_dump(mode="json") if rec is not None else None}


def drawn(task: Task) -> dict[str, Any]:
    """The recommendation as far as it got: candidates, ranked rows, Pareto charts (fronts once ranked)."""
    rec = task.state.get("recommendation")
    if rec is None:
        return {"task": task, "rec": None}
    artifacts = {c.name: c.artifact for c in rec.candidates if c.status == "done" and c.artifact}
    rows = [(r, presented.cells(r), artifacts.get(r.candidate)) for r in rec.ranked()]
    return {"task": task, "rec": rec, "head": presented.HEAD, "rows": rows, "charts": presented.pareto_charts(rec),
            "pick": rec.picks.get(rec.spec.goal), "command": rec.deploy_command(rec.spec.goal)}


@api.post("/recommendations", status_code=202, summary="Start a recommendation in the background")
def create_recommendation(request: Request, body: CreateRecommendation) -> dict[str, Any]:
    task = request.app.state.tasks.start(KIND, f"{body.model} for {body.goal}", _work(body), wait_s=ACCEPT_WAIT_S)
    return described(task)


@api.get("/recommendations", summary="The recommendations this studio has run")
def list_recommendations(request: Request) -> list[dict[str, Any]]:
    return [t.summary() for t in request.app.state.tasks.list(KIND)]


@api.get("/recommendations/{task_id}", summary="A recommendation: progress, candidates, rows, picks")
def get_recommendation(request: Request, task_id: str) -> dict[str, Any]:
    return described(request.app.state.tasks.get(task_id, KIND))


@pages.get("/recommendations", response_class=HTMLResponse)
def recommendations_page(request: Request, model: str | None = None) -> HTMLResponse:
    return page(request, "recommendations.html", tasks=request.app.state.tasks.list(KIND), models=sdk.list_models(),
                catalogue=sdk.catalog_models(), chosen=model or sdk.DEFAULT_MODEL)


@pages.get("/recommendations/{task_id}", response_class=HTMLResponse)
def recommendation_page(request: Request, task_id: str) -> HTMLResponse:
    return page(request, "recommendation.html", **drawn(request.app.state.tasks.get(task_id, KIND)))


@pages.get("/recommendations/{task_id}/live")
async def recommendation_live(request: Request, task_id: str) -> EventSourceResponse:
    """The task is in memory: the stream looks at its version once a second, and reads no database."""
    task = request.app.state.tasks.get(task_id, KIND)

    async def events() -> AsyncIterator[dict[str, str]]:
        shown = -1
        while True:
            if task.version != shown:
                shown = task.version
                yield {"event": "body", "data": fragment("_recommendation_body.html", **drawn(task))}
            if task.status != "running":
                yield {"event": "end", "data": ""}
                return
            await asyncio.sleep(POLL_S)

    return EventSourceResponse(events())

"""Pages: the Jinja2 templates, with the number formats the terminal and the report use, so a
figure reads the same everywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from starlette.responses import HTMLResponse

from llmopt import sdk
from llmopt.presentation import format as formats
from llmopt.presentation.recommendation import recipe_line

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"
NAV = (("/models", "Models"), ("/jobs/new", "Optimize"), ("/jobs", "Jobs"), ("/evaluations", "Evaluations"),
       ("/recommendations", "Recommendations"), ("/endpoints", "Endpoints"), ("/hardware", "Hardware prices"))

templates = Jinja2Templates(directory=str(TEMPLATES))
templates.env.filters.update(
    when=formats.when, num=formats.num, money=formats.money, pct=formats.pct, times=formats.times,
    megabytes=formats.megabytes, recipe=recipe_line, tojson_pretty=lambda v: json.dumps(v, indent=2, default=str),
    svg=Markup,  # charts drawn by llmopt.presentation, which escapes every label it writes
)
templates.env.globals.update(nav=NAV, JOB_ACTIVE=sdk.ACTIVE_JOB_STATUSES, EVALUATION_ACTIVE=sdk.ACTIVE_EVALUATION_STATUSES,
                             ENDPOINT_LIVE=sdk.LIVE_ENDPOINT_STATUSES)


def duration(start: float | None, end: float | None) -> str:
    if not start or not end:
        return ""
    seconds = end - start
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def active_nav(path: str) -> str:
    """The navigation entry a page belongs to: the longest that prefixes its path."""
    matches = [href for href, _ in NAV if path == href or path.startswith(href + "/")]
    return max(matches, key=len, default="")


templates.env.globals.update(duration=duration, active_nav=active_nav)


PAGE_SIZE = 100  # rows on a list page; older ones are a click away


def paged(kind: str, oldest_first: list[Any], offset: int, limit: int) -> dict[str, Any]:
    """One page of a list of records, newest first, with what the pager needs."""
    newest = oldest_first[::-1]
    return {kind: newest[offset:offset + limit], "total": len(newest), "offset": offset, "limit": limit}


def page(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """A whole page, or a fragment (a template whose name starts with '_')."""
    return templates.TemplateResponse(request, template, context, status_code=status_code)


def fragment(template: str, **context: Any) -> str:
    """A fragment as text, for server-sent events."""
    return templates.get_template(template).render(**context)

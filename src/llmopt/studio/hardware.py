"""Hardware prices: the reference profiles and the user's own (which override them by name), as
evaluations and recommendations price a token; the user's are editable here."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from llmopt.evaluation import pricing
from llmopt.studio import hardware_file
from llmopt.studio.problems import ERRORS, lookup
from llmopt.studio.recipes import this_machine
from llmopt.studio.rendering import page

api = APIRouter(tags=["hardware"], responses=ERRORS)
pages = APIRouter(include_in_schema=False)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = Field(min_length=1, max_length=500)
    price_per_hour: float = Field(description="On-demand dollars per hour.")
    as_of: str = Field(min_length=1, max_length=40, description="When the price was read, e.g. 2026-01.")
    discount: float = Field(0.0, description="A fraction off the hourly price, in [0, 1).")


def listed() -> list[dict[str, Any]]:
    return [{**p.model_dump(mode="json"), "origin": origin} for p, origin in hardware_file.profiles()]


@api.get("/hardware", summary="Hardware price profiles: the reference ones and yours")
def list_profiles() -> list[dict[str, Any]]:
    return listed()


@api.put("/hardware/{name}", summary="Add or replace one of your price profiles")
def save_profile(name: str, body: Profile) -> dict[str, Any]:
    return hardware_file.save(name, body.model_dump()).model_dump(mode="json")


@api.delete("/hardware/{name}", summary="Remove one of your price profiles (a reference one comes back)")
def remove_profile(name: str) -> dict[str, str]:
    lookup(hardware_file.remove, name)
    return {"removed": name}


@pages.get("/hardware", response_class=HTMLResponse)
def hardware_page(request: Request) -> HTMLResponse:
    suggested = pricing.for_hardware(this_machine()).name
    return page(request, "hardware.html", profiles=listed(), suggested=suggested, machine=this_machine())

"""Models: the catalogue and the store, importing and removing, and a model's deployment
configurations (each deployable in one click)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field

from llmopt import sdk
from llmopt.studio import endpoints
from llmopt.studio.problems import ERRORS, NotFound, lookup
from llmopt.studio.rendering import page

api = APIRouter(tags=["models"], responses=ERRORS)
pages = APIRouter(include_in_schema=False)


class ImportModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: str = Field(min_length=1, description="A catalogue id, a Hugging Face model folder or a .gguf file on this machine.")
    name: str | None = Field(None, description="The id to store it under (default: from the spec).")


class DeployConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="Endpoint name (default: generated).")
    api_key: str | None = Field(None, description="Require this key on every route of the endpoint.")


def catalogue() -> list[dict[str, Any]]:
    imported = {m.id for m in sdk.list_models()}
    return [{**asdict(c), "imported": c.id in imported} for c in sdk.catalog_models()]


def configurations(model_id: str) -> list[dict[str, Any]]:
    """An imported model's deployment configurations, with what holds for each here (`sdk.config_listing`)."""
    return sdk.config_listing(sdk.configs(lookup(sdk.get_model, model_id).id))


def cards(listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One card per configuration name: the one `deploy --config` takes (the first listed, so this
    machine's when measured here), with the same name's rows from other machines, or from the other
    source, under it as `elsewhere`. Otherwise a name measured on three kinds of machine would show
    three Deploy buttons that all deploy the first."""
    named: dict[str, dict[str, Any]] = {}
    for config in listed:
        if config["name"] in named:
            named[config["name"]]["elsewhere"].append(config)
        else:
            named[config["name"]] = {**config, "elsewhere": []}
    return list(named.values())


@api.get("/models", summary="Imported models")
def list_models() -> list[dict[str, Any]]:
    return [m.to_dict() for m in sdk.list_models()]


@api.get("/catalog", summary="The models llmopt knows by id")
def list_catalogue() -> list[dict[str, Any]]:
    return catalogue()


@api.post("/models", status_code=201, summary="Import a catalogue id, a Hugging Face folder or a GGUF file")
def import_model(body: ImportModel) -> dict[str, Any]:
    return sdk.import_model(body.spec, name=body.name).to_dict()


@api.get("/models/{model_id}", summary="An imported model")
def get_model(model_id: str) -> dict[str, Any]:
    return lookup(sdk.get_model, model_id).to_dict()


@api.delete("/models/{model_id}", summary="Remove an imported model and its folder")
def remove_model(model_id: str) -> dict[str, str]:
    lookup(sdk.get_model, model_id)
    sdk.remove_model(model_id)
    return {"removed": model_id}


@api.get("/models/{model_id}/configs", summary="A model's deployment configurations")
def list_configs(model_id: str) -> list[dict[str, Any]]:
    return configurations(model_id)


@api.post("/models/{model_id}/configs/{config}/deploy", status_code=202,
          summary="Build (or reuse) a configuration's artifact and deploy it, in the background")
def deploy_config(request: Request, model_id: str, config: str, body: DeployConfig) -> dict[str, Any]:
    lookup(sdk.get_model, model_id)
    known = sorted({c.name for c in sdk.configs(model_id)})
    if config not in known:
        raise NotFound(f"no deployment configuration '{config}' for '{model_id}'",
                       f"use one of {', '.join(known)}" if known else "measure some on the Recommendations page")
    name = body.name or endpoints.default_name(f"{model_id}-{config}")
    task = request.app.state.tasks.start(
        "deploy-config", f"{model_id} configuration {config} as {name}",
        lambda task: sdk.deploy(model_id, name=name, api_key=body.api_key, config=config).to_dict())
    return {"task": task.summary(), "endpoint": name}


@pages.get("/models", response_class=HTMLResponse)
def models_page(request: Request) -> HTMLResponse:
    return page(request, "models.html", imported=sdk.list_models(), catalogue=catalogue())


@pages.get("/models/{model_id}", response_class=HTMLResponse)
def model_page(request: Request, model_id: str) -> HTMLResponse:
    listed = {c["id"]: c for c in catalogue()}
    model = next((m for m in sdk.list_models() if m.id == model_id), None)
    if model is None and model_id not in listed:
        lookup(sdk.get_model, model_id)
    return page(request, "model.html", model=model, entry=listed.get(model_id), model_id=model_id,
                configs=cards(configurations(model_id)) if model else [])

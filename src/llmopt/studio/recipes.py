"""Recipes: the built-ins, the schema, the compatibility matrix, an uploaded recipe file read as
the CLI reads one, and the live check the builder runs on every change (the recipe validated, then
checked against the model and this machine: refusals and warnings, and the recipe's YAML)."""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from fastapi import APIRouter, UploadFile
from pydantic import BaseModel, ConfigDict, Field

from llmopt import names, recipe, sdk, techniques
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.studio.problems import ERRORS, lookup
from llmopt.studio.recipe_form import minimal

api = APIRouter(tags=["recipes"], responses=ERRORS)
this_machine = cache(platform.detect)  # the machine does not change while the studio runs


class Check(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="An imported model (or a catalogue id, checked without its config).")
    recipe: dict[str, Any] = Field(default_factory=dict, description="A recipe as `llmopt recipes schema` describes it.")


class Notes(BaseModel):
    refusals: list[str] = []
    warnings: list[str] = []


class Verdict(Notes):
    recipe: dict[str, Any]
    yaml: str
    techniques: list[str]
    sections: dict[str, Notes] = {}  # the notes each section brings on its own, shown beside it


def described(parsed: Any, notes: Notes | None = None, sections: dict[str, Notes] | None = None) -> Verdict:
    shown = minimal(parsed)
    notes = notes or Notes()
    return Verdict(recipe=shown, yaml=yaml.safe_dump(shown, sort_keys=False), techniques=parsed.techniques(),
                   refusals=notes.refusals, warnings=notes.warnings, sections=sections or {})


def by_section(parsed: Any, model: Any, whole: Notes) -> dict[str, Notes]:
    """Which of the recipe's notes each section brings on its own (checked alone); a note that
    comes from sections together stays with the recipe as a whole."""
    found = {}
    for section, data in parsed.to_dict().items():
        if section == "name":
            continue
        try:
            alone = techniques.check(recipe.parse({section: data}), model, this_machine())
        except LlmoptError:
            continue  # this section means something only with the others
        found[section] = Notes(refusals=[m for m in whole.refusals if m in alone.refusals],
                               warnings=[m for m in whole.warnings if m in alone.warnings])
    return found


def check(model_id: str, data: dict[str, Any]) -> Verdict:
    """A catalogue model not imported yet is checked against the matrix when its job starts."""
    model = next((m for m in sdk.list_models() if m.id == model_id), None)
    if model is None and model_id not in {c.id for c in sdk.catalog_models()}:
        lookup(sdk.get_model, model_id)
    parsed = recipe.parse(data)
    if model is None:
        return described(parsed, Notes(warnings=[f"'{model_id}' is not imported yet: the checks that read its config run when "
                                                 "the job starts (import it on the Models page to check now)"]))
    verdict = techniques.check(parsed, model, this_machine())
    whole = Notes(refusals=verdict.refusals, warnings=verdict.warnings)
    return described(parsed, whole, by_section(parsed, model, whole))


@api.get("/recipes", summary="The built-in recipes, by name")
def list_recipes() -> dict[str, dict[str, Any]]:
    return {name: r.to_dict() for name, r in sdk.list_recipes().items()}


@api.get("/recipes/schema", summary="The JSON schema of recipes: every section and knob")
def recipe_schema() -> dict[str, Any]:
    return sdk.recipe_schema()


@api.get("/recipes/matrix", summary="The compatibility matrix")
def matrix() -> list[dict[str, Any]]:
    return [row.model_dump(mode="json") for row in sdk.compatibility_matrix()]


@api.post("/recipes/check", summary="Validate a recipe and check it against a model on this machine")
def check_recipe(body: Check) -> Verdict:
    return check(body.model, body.recipe)


@api.post("/recipes/upload", summary="Read a recipe file (YAML or JSON) as `llmopt optimize -r FILE` would")
def upload_recipe(file: UploadFile) -> Verdict:
    filename = Path(file.filename or "recipe.yaml").name
    suffix = ".json" if filename.endswith(".json") else ".yaml"
    with tempfile.TemporaryDirectory(prefix="llmopt-recipe-") as folder:
        path = Path(folder) / f"{names.slug(Path(filename).stem, 'recipe')}{suffix}"
        path.write_bytes(file.file.read(recipe.MAX_FILE_BYTES + 1))
        try:
            return described(sdk.load_recipe(path))
        except LlmoptError as exc:
            raise LlmoptError(exc.problem.replace(str(path), filename), exc.fix) from None

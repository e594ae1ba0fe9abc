"""Recipes: the techniques to apply to a model, as one typed, validated, serializable object.

A recipe has a section per registered technique (`techniques.REGISTRY`), each typed by the
technique that owns it. It round-trips through YAML and JSON, and every knob is checked when it
is built; so are contradictions between sections (the engine settings the recipe asks for must
be possible). Whether a recipe can run on a given model and machine is a separate question,
answered by `techniques.check` before any work starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from llmopt import techniques
from llmopt.errors import LlmoptError

MAX_FILE_BYTES = 1 << 20


class _RecipeBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "_RecipeBase":
        """Sections that contradict each other show up in the engine settings they ask for together."""
        try:
            techniques.engine(self)
        except ValidationError as exc:
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
        return self

    def techniques(self) -> list[str]:
        """The recipe's techniques, as the compatibility matrix names them."""
        return techniques.names(self)

    @property
    def tensor_parallel_size(self) -> int:
        return techniques.engine(self).tensor_parallel_size

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def merged(self, overrides: dict[str, Any]) -> "Recipe":
        """A copy with whole sections replaced by `overrides` (flags win over the file); the
        result is no longer the named recipe, so it loses the name."""
        data = {**self.to_dict(), **overrides}
        data.pop("name", None)
        return parse(data, origin="flags")


Recipe = create_model(  # one optional section per technique, typed by the technique that owns it
    "Recipe",
    __base__=_RecipeBase,
    __doc__="What to apply to a model. An empty recipe is the baseline: package the model as it is.",
    **{t.section: (t.spec | None, None) for t in techniques.REGISTRY},
)

BUILTIN: dict[str, dict[str, Any]] = {
    "baseline": {"name": "baseline"},
    "kv-fp8": {"name": "kv-fp8", "kv_cache": {"dtype": "fp8"}},
    "ngram": {"name": "ngram", "speculative": {"method": "ngram"}},
    "awq": {"name": "awq", "quantization": {"method": "awq"}},
    "smoothquant": {"name": "smoothquant", "quantization": {"method": "smoothquant"}},
    "fp8-block": {"name": "fp8-block", "quantization": {"method": "fp8", "scheme": "block"}},
}


def parse(data: Any, origin: str = "recipe") -> Any:
    """Build a recipe from plain data, turning validation errors into one readable line."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LlmoptError(f"{origin}: a recipe must be a mapping, got {type(data).__name__}", "see `llmopt recipes show baseline`")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise LlmoptError(f"{origin}: {_describe(exc)}", "fix the recipe; `llmopt recipes schema` lists every key") from None


def load(spec: str | Path) -> Any:
    """A recipe from a built-in name or a YAML/JSON file."""
    if isinstance(spec, str) and spec in BUILTIN:
        return parse(BUILTIN[spec], origin=f"built-in recipe {spec}")
    path = Path(spec)
    if not path.is_file():
        raise LlmoptError(
            f"no recipe file or built-in recipe named '{spec}'",
            f"pass a .yaml/.json file or one of: {', '.join(BUILTIN)}",
        )
    if path.stat().st_size > MAX_FILE_BYTES:
        raise LlmoptError(f"{path}: {path.stat().st_size} bytes is too large for a recipe", "pass a recipe file under 1 MB")
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except UnicodeDecodeError:
        raise LlmoptError(f"{path}: not UTF-8 text", "save the recipe as UTF-8") from None
    except (yaml.YAMLError, json.JSONDecodeError, RecursionError) as exc:
        raise LlmoptError(f"{path}: cannot parse ({' '.join(str(exc).split())[:300]})", "fix the file's syntax") from None
    return parse(data, origin=str(path))


def save(recipe: Any, path: Path) -> None:
    path.write_text(recipe.to_json() if path.suffix == ".json" else recipe.to_yaml())


def schema() -> dict[str, Any]:
    """The JSON schema of recipes: every section and knob."""
    return Recipe.model_json_schema()


def _describe(exc: ValidationError) -> str:
    messages = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "recipe"
        if error["type"] == "extra_forbidden":
            parent, key = error["loc"][:-1], error["loc"][-1]
            messages.append(f"unknown key '{key}' in {'.'.join(map(str, parent)) or 'recipe'}; valid keys: {', '.join(_valid_keys(parent))}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            messages.append(f"{where}: {message}" if error["loc"] else message)
    return "; ".join(messages)


def _valid_keys(loc: tuple) -> list[str]:
    """The field names accepted at a location of the recipe (for the unknown-key message)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        if isinstance(model, list):  # a discriminated union: this part is its tag ('awq', 'ngram', ...)
            model = {m.model_fields["method"].default: m for m in model if "method" in m.model_fields}.get(part, model)
            continue
        field = model.model_fields.get(part)
        candidates = _models(field.annotation) if field is not None else []
        if candidates:
            model = candidates[0] if len(candidates) == 1 else candidates
    return sorted(model.model_fields) if isinstance(model, type) else []


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (through Optional, Union and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models(arg)]


def flag_overrides(
    quantize: str | None = None,
    kv_cache: str | None = None,
    speculative: str | None = None,
    compile: bool = False,
    tensor_parallel: int | None = None,
) -> dict[str, Any]:
    """Recipe sections for the command line's shortcut flags; each replaces its whole section."""
    sections: dict[str, Any] = {}
    if quantize:
        sections["quantization"] = {"method": quantize}
    if kv_cache:
        sections["kv_cache"] = {"dtype": kv_cache}
    if speculative:
        if speculative == "ngram":
            sections["speculative"] = {"method": "ngram"}
        elif speculative.startswith("draft"):
            _, _, model = speculative.partition("=")
            sections["speculative"] = {"method": "draft_model", "model": model or "recommended"}
        else:
            raise LlmoptError(f"unknown --speculative value '{speculative}'", "use ngram, draft or draft=MODEL_ID_OR_PATH")
    if compile:
        sections["compilation"] = {}
    if tensor_parallel is not None:
        sections["sharding"] = {"tensor_parallel_size": tensor_parallel}
    return sections

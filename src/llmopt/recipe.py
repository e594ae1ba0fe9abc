"""Recipes: the techniques to apply to a model, as typed, validated, serializable objects.

A recipe is data: it round-trips through YAML and JSON, and every knob is checked when it is
built. Whether a recipe can run on a given model, engine and machine is a separate question,
answered by `compatibility.check` before any work starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmopt.errors import LlmoptError


class _Technique(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Calibration(_Technique):
    """Data that calibration-based quantization sees."""

    dataset: str = Field("builtin", description="'builtin' (text shipped with llmopt) or a JSONL path.")
    samples: int = Field(64, gt=0, le=4096)
    sequence_length: int = Field(384, gt=0, le=32768)


class AWQ(_Technique):
    """INT4 weight-only (W4A16) with activation-aware scaling."""

    method: Literal["awq"] = "awq"
    group_size: int = Field(128, gt=0)
    symmetric: bool = False
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    calibration: Calibration = Field(default_factory=Calibration)
    max_perplexity_increase: float = Field(0.12, ge=0, description="Quality budget, as a fraction.")


class SmoothQuant(_Technique):
    """SmoothQuant then INT8 weights per channel and INT8 activations per token, dynamic (W8A8)."""

    method: Literal["smoothquant"] = "smoothquant"
    alpha: float = Field(0.8, gt=0, lt=1)
    weights: Literal["gptq", "rtn"] = "gptq"
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    calibration: Calibration = Field(default_factory=Calibration)
    max_perplexity_increase: float = Field(0.03, ge=0)


class FP8(_Technique):
    """FP8 weights and activations: dynamic per-channel, or block-wise."""

    method: Literal["fp8"] = "fp8"
    scheme: Literal["block", "dynamic"] = "block"
    block_size: tuple[int, int] = (128, 128)
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    max_perplexity_increase: float = Field(0.02, ge=0)


Quantization = Annotated[Union[AWQ, SmoothQuant, FP8], Field(discriminator="method")]


class KVCache(_Technique):
    dtype: Literal["auto", "fp8", "fp8_e5m2"] = "fp8"


class SpeculationSweep(_Technique):
    """How a job finds where speculation stops paying: output tokens/s with and without it, side by
    side on this machine, at each concurrency level, on this workload (the user's own JSONL is best)."""

    dataset: str = Field("builtin-qa", description="builtin-qa, sharegpt, synthetic:IN,OUT or a JSONL path.")
    concurrency: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1)
    requests: int = Field(8, gt=0, le=4096, description="Requests per level, per engine.")

    @model_validator(mode="after")
    def _levels(self) -> "SpeculationSweep":
        if any(c <= 0 for c in self.concurrency) or list(self.concurrency) != sorted(set(self.concurrency)):
            raise ValueError(f"sweep concurrency must be increasing positive integers, got {list(self.concurrency)}")
        return self


class _Speculation(_Technique):
    disable_above_batch: int | Literal["auto", "never"] = Field(
        "auto",
        description="Propose no drafts when more sequences than this are batched. 'auto' measures where speculation "
        "stops paying (see sweep); 'never' speculates at every batch size.",
    )
    sweep: SpeculationSweep = Field(default_factory=SpeculationSweep)

    @model_validator(mode="after")
    def _batch(self) -> "_Speculation":
        if isinstance(self.disable_above_batch, int) and self.disable_above_batch <= 0:
            raise ValueError(f"disable_above_batch must be positive, 'auto' or 'never', got {self.disable_above_batch}")
        return self


class DraftModel(_Speculation):
    """Speculative decoding with a smaller draft model of the same tokenizer."""

    method: Literal["draft_model"] = "draft_model"
    model: str = Field("recommended", description="'recommended', a catalogue id, an imported model or a folder.")
    quantization: Quantization | None = Field(
        None,
        description="Quantize the draft before it goes into the artifact: a cheaper draft proposes faster, and the "
        "target still verifies every token. Unset with model 'recommended', the catalogue's choice for that draft applies.",
    )
    # Qwen2.5-Coder 0.5B (INT8, the catalogue's recommendation) for 1.5B on two cores: k=3 gave
    # 2.02x at concurrency 1 and beat k=2 at every level and k=4 from concurrency 2 (benchmarks/README.md)
    num_speculative_tokens: int = Field(3, gt=0, le=16)

    def __init__(self, model: str = "recommended", **data: Any) -> None:
        super().__init__(model=model, **data)


class NGram(_Speculation):
    """Draft-free speculation that proposes continuations found in the prompt (prompt lookup)."""

    method: Literal["ngram"] = "ngram"
    # 3 beat 2 and 4 at concurrency 1, 2 and 4 on the QA workload (benchmarks/speculative.py: 1.63x
    # against 1.53x and 1.30x at concurrency 1); 4 is accepted too rarely to pay for its verification
    num_speculative_tokens: int = Field(3, gt=0, le=16)
    prompt_lookup_min: int = Field(2, gt=0)
    prompt_lookup_max: int = Field(4, gt=0)

    @model_validator(mode="after")
    def _window(self) -> "NGram":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


Speculative = Annotated[Union[DraftModel, NGram], Field(discriminator="method")]


class Compilation(_Technique):
    """Ahead-of-time compilation for fixed serving shapes, kept in the compile cache."""

    max_num_seqs: int = Field(16, gt=0)
    max_model_len: int = Field(4096, gt=0)


class Sharding(_Technique):
    tensor_parallel_size: int = Field(1, gt=0)


class Recipe(_Technique):
    """What to apply to a model. An empty recipe is the baseline: package the model as it is."""

    name: str | None = None
    quantization: Quantization | None = None
    kv_cache: KVCache | None = None
    speculative: Speculative | None = None
    compilation: Compilation | None = None
    sharding: Sharding | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        """Techniques that contradict each other."""
        if self.speculative and self.compilation and self.speculative.num_speculative_tokens >= self.compilation.max_model_len:
            raise ValueError("speculative.num_speculative_tokens must be smaller than compilation.max_model_len")
        return self

    @property
    def tensor_parallel_size(self) -> int:
        return self.sharding.tensor_parallel_size if self.sharding else 1

    def techniques(self) -> list[str]:
        """Names of the techniques in the recipe, as the compatibility matrix spells them."""
        names = []
        if self.quantization:
            q = self.quantization
            names.append(f"quantization.{q.method}" + (f".{q.scheme}" if isinstance(q, FP8) else ""))
        if self.kv_cache and self.kv_cache.dtype != "auto":
            names.append(f"kv_cache.{self.kv_cache.dtype}")
        if self.speculative:
            names.append(f"speculative.{self.speculative.method}")
        if self.compilation:
            names.append("compilation")
        if self.tensor_parallel_size > 1:
            names.append("sharding.tensor_parallel")
        return names

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


BUILTIN: dict[str, dict[str, Any]] = {
    "baseline": {"name": "baseline"},
    "kv-fp8": {"name": "kv-fp8", "kv_cache": {"dtype": "fp8"}},
    "ngram": {"name": "ngram", "speculative": {"method": "ngram"}},
    "awq": {"name": "awq", "quantization": {"method": "awq"}},
    "smoothquant": {"name": "smoothquant", "quantization": {"method": "smoothquant"}},
    "fp8-block": {"name": "fp8-block", "quantization": {"method": "fp8", "scheme": "block"}},
}


def parse(data: Any, origin: str = "recipe") -> Recipe:
    """Build a recipe from plain data, turning validation errors into one readable line."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LlmoptError(f"{origin}: a recipe must be a mapping, got {type(data).__name__}", "see `llmopt recipes show baseline`")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise LlmoptError(f"{origin}: {_describe(exc)}", "fix the recipe; `llmopt recipes schema` lists every key") from None


def load(spec: str | Path) -> Recipe:
    """A recipe from a built-in name or a YAML/JSON file."""
    if isinstance(spec, str) and spec in BUILTIN:
        return parse(BUILTIN[spec], origin=f"built-in recipe {spec}")
    path = Path(spec)
    if not path.is_file():
        raise LlmoptError(
            f"no recipe file or built-in recipe named '{spec}'",
            f"pass a .yaml/.json file or one of: {', '.join(BUILTIN)}",
        )
    try:
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise LlmoptError(f"{path}: cannot parse ({' '.join(str(exc).split())})", "fix the file's syntax") from None
    return parse(data, origin=str(path))


def save(recipe: Recipe, path: Path) -> None:
    path.write_text(recipe.to_json() if path.suffix == ".json" else recipe.to_yaml())


def _describe(exc: ValidationError) -> str:
    messages = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "recipe"
        if error["type"] == "extra_forbidden":
            parent, key = error["loc"][:-1], error["loc"][-1]
            messages.append(f"unknown key '{key}' in {'.'.join(map(str, parent)) or 'recipe'}; valid keys: {', '.join(_valid_keys(parent))}")
        else:
            messages.append(f"{where}: {error['msg']}")
    return "; ".join(messages)


def _valid_keys(loc: tuple) -> list[str]:
    """The field names accepted at a location of the recipe (for the unknown-key message)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:  # a discriminated union's tag ('awq', 'ngram', ...)
            tagged = {m.model_fields["method"].default: m for m in (AWQ, SmoothQuant, FP8, DraftModel, NGram)}
            model = tagged.get(part, model)
            continue
        annotation = field.annotation
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(candidates) == 1:
            model = candidates[0]
    return sorted(model.model_fields)


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
    if tensor_parallel:
        sections["sharding"] = {"tensor_parallel_size": tensor_parallel}
    return sections

"""Speculative decoding: a draft model (copied, or quantized, into the artifact) or draft-free
n-gram lookup proposes tokens that the target verifies in one step. It only pays where drafts are
accepted and the batch is small, so a job measures where it stops paying (the sweep), and every
engine that runs it proves it proposes and accepts drafts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, TypeAdapter, model_validator

from llmopt import catalog, hashing, sources
from llmopt.engine import metrics as engine_metrics
from llmopt.engine import vllm
from llmopt.engine.platform import Hardware
from llmopt.engine.config import EngineConfig, SpeculativeConfig
from llmopt.errors import LlmoptError
from llmopt.evaluation import compare, levels, workload
from llmopt.evaluation.results import Level, Ratio
from llmopt.techniques import quantization
from llmopt.techniques.base import BuildContext, CheckContext, Reference, Running, Section, Step, Technique, check_section
from llmopt.techniques.quantization.schemes import Quantization
from llmopt.techniques.served import served

DRAFT_DIR = "draft"


class SpeculationSweep(Section):
    """How a job finds where speculation stops paying: the same work with and without it, side by
    side on this machine, at each concurrency level, on a workload like the model's (the user's own
    JSONL is best)."""

    dataset: str = Field("auto", description="'auto' (the catalogue's workload for the model: coding prompts for "
                         "coder models, QA otherwise), builtin-qa, builtin-coding, sharegpt, synthetic:IN,OUT or a JSONL path.")
    concurrency: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1)
    requests: int = Field(8, gt=0, le=4096, description="Requests per level, per engine (at least 4 per concurrent user).")
    output_tokens: int | None = Field(
        None, gt=0, le=4096, description="Tokens every request generates (end-of-sequence ignored). None: each prompt's "
        "natural answer length, measured once without speculation and replayed on both engines. Either way both do the "
        "same work; natural lengths weigh prefill and decoding as the workload's own answers do.")

    @model_validator(mode="after")
    def _levels(self) -> "SpeculationSweep":
        levels.check_rising(self.concurrency, "sweep concurrency")
        return self


class _Speculation(Section):
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
    prompt_lookup_min: int = Field(2, gt=0, le=64)
    prompt_lookup_max: int = Field(4, gt=0, le=64)

    @model_validator(mode="after")
    def _window(self) -> "NGram":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


Speculative = Annotated[Union[DraftModel, NGram], Field(discriminator="method")]


class SweepRow(BaseModel):
    """One level of the sweep, on equal work."""

    concurrency: int
    output_tokens_per_s: float
    output_tokens_per_s_without: float
    speedup: Ratio  # output tokens/s with over without, with its interval
    decode_speedup: float | None  # time per output token without over with: what speculation changes
    ttft_cost_ms: float | None  # TTFT with minus without (p50): a draft's own prefill, and verifying
    acceptance_rate: float
    mean_accepted_length: float

    @property
    def loses(self) -> bool:
        """Slower, by the best estimate: what decides where speculation is switched off. Waiting for a
        loss outside the noise (up to ~20% between two deployments) kept speculation on where it cost
        the demo 1.33x in requests/s at concurrency 4."""
        return self.speedup.value < 1.0

    @property
    def loses_outside_noise(self) -> bool:
        """Slower beyond doubt: the whole interval is below 1. Only this fails a job."""
        return self.speedup.high < 1.0


class Sweep(BaseModel):
    dataset: str
    output_tokens: int | None  # None: each prompt's natural length, measured without speculation
    requests_per_level: int
    levels: list[SweepRow]  # up to the first level that loses: higher levels are not run
    first_losing_level: int | None = None
    disable_above_batch: int | None = None  # where the job switched speculation off


class SpeculativeRecord(BaseModel):
    draft_quantization: quantization.QuantizationRecord | None = None
    sweep: Sweep | None = None


class Draft(BaseModel):
    """The model a recipe drafts with, and how it is quantized before it drafts."""

    model: sources.Model
    quantization: Quantization | None


def catalog_id(model: sources.Model) -> str | None:
    """The catalogue id a store model came from, if any."""
    if model.source.startswith("catalog:"):
        return model.source.split(":", 1)[1]
    return model.id if catalog.is_catalog_id(model.id) else None


def resolve_draft(spec: DraftModel, target: sources.Model) -> Draft:
    name, quantized = spec.model, spec.quantization
    if name == "recommended":
        target_id = catalog_id(target)
        if target_id is None:
            raise LlmoptError(
                f"'{target.id}' is not a catalogue model, so it has no recommended draft",
                "name a draft model (speculative.model) or use method ngram",
            )
        entry = catalog.get(target_id)
        name = entry.recommended_draft
        if name == "ngram":
            raise LlmoptError(
                f"'{target_id}' has no smaller sibling to draft with; its recommended method is ngram",
                "use `--speculative ngram` (method: ngram)",
            )
        if quantized is None and entry.recommended_draft_quantization:
            quantized = TypeAdapter(Quantization).validate_python(entry.recommended_draft_quantization)
    return Draft(model=sources.resolve(name), quantization=quantized)


class SpeculativeTechnique(Technique):
    section = "speculative"
    spec = Speculative
    metrics = SpeculativeRecord
    verification = engine_metrics.SpeculationStats

    def names(self, spec: DraftModel | NGram) -> list[str]:
        return [f"speculative.{spec.method}"]

    def configure(self, spec: DraftModel | NGram, engine: EngineConfig) -> EngineConfig:
        if isinstance(spec, NGram):
            config = SpeculativeConfig(method="ngram", num_speculative_tokens=spec.num_speculative_tokens,
                                       prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
        else:
            config = SpeculativeConfig(method="draft_model", num_speculative_tokens=spec.num_speculative_tokens,
                                       model=vllm.ARTIFACT_RELATIVE + DRAFT_DIR)
        if isinstance(spec.disable_above_batch, int):
            config = config.disabled_above(spec.disable_above_batch)
        return engine.model_copy(update={"speculative": config})

    def check(self, spec: DraftModel | NGram, ctx: CheckContext) -> None:
        """A draft fits its target (its quantization checked like a recipe of its own); the workload
        the sweep measures on can be read."""
        if isinstance(spec, DraftModel):
            draft = _check_draft(spec, ctx)
            if draft is not None and draft.quantization is not None:
                of_draft = CheckContext(draft.model, _config(draft.model), ctx.hardware, ctx.engine, type(ctx.verdict)())
                check_section(quantization.TECHNIQUE, draft.quantization, of_draft)
                ctx.verdict.refusals += [f"draft quantization: {r}" for r in of_draft.verdict.refusals]
                ctx.verdict.warnings += [f"draft quantization: {w}" for w in of_draft.verdict.warnings]
        if spec.disable_above_batch == "auto":
            try:
                workload.check(sweep_dataset(spec.sweep, ctx.target), ctx.target.path)
            except LlmoptError as exc:
                ctx.verdict.refusals.append(f"speculative.sweep.dataset: {exc.problem}; {exc.fix}")

    def key(self, spec: DraftModel | NGram, source: sources.Model, hardware: Hardware) -> dict[str, Any]:
        """The draft's content and quantization (the catalogue may recommend one, with its calibration
        text), and the user's workload the sweep measures on (where speculation pays depends on it)."""
        extras: dict[str, Any] = {}
        if isinstance(spec, DraftModel):
            draft = resolve_draft(spec, source)
            extras["draft"] = draft.model.content_hash
            if draft.quantization is not None:
                extras["draft_quantization"] = draft.quantization.model_dump(mode="json")
                extras |= {f"draft_{k}": v for k, v in quantization.TECHNIQUE.key(draft.quantization, draft.model, hardware).items()}
        sweep_file = Path(spec.sweep.dataset)
        if spec.disable_above_batch == "auto" and sweep_file.is_file():
            extras["sweep"] = hashing.file_sha256(sweep_file)
        return extras

    def steps(self, spec: DraftModel | NGram) -> list[Step]:
        steps = [Step("speculative", self._draft)]
        if spec.disable_above_batch == "auto":
            steps.append(Step("speculation-sweep", self._sweep))
        return steps

    def _draft(self, ctx: BuildContext) -> None:
        spec = ctx.recipe.speculative
        record = SpeculativeRecord()
        if isinstance(spec, DraftModel):
            draft = resolve_draft(spec, ctx.source)
            dest = ctx.workdir / DRAFT_DIR
            reference = Reference(model=draft.model.id, content_hash=draft.model.content_hash, path=DRAFT_DIR)
            if draft.quantization is None:
                shutil.copytree(draft.model.path, dest)
            else:
                ctx.log.info("quantizing the draft %s (%s) before it drafts", draft.model.id, draft.quantization.method)
                dest.mkdir()
                record.draft_quantization = quantization.quantize_model(
                    draft.quantization, draft.model, dest, ctx.engine.tensor_parallel_size, ctx.log,
                    lambda f: ctx.progress(0.95 * f))
                reference.quantization = draft.quantization.method
            ctx.references["draft"] = reference
        ctx.metrics[self.section] = record
        ctx.log.info("speculative settings: %s", ctx.engine.speculative.model_dump(exclude_none=True) if ctx.engine.speculative else None)
        ctx.progress(1.0)

    def _sweep(self, ctx: BuildContext) -> None:
        """Serve the artifact without speculation and load it at every level, then with speculation
        level by level, on equal work; stop at the first level that loses and switch speculation off
        above the last one that did not (or fail, if the first loses outside the noise)."""
        spec = ctx.recipe.speculative
        dataset = sweep_dataset(spec.sweep, ctx.source)
        if not Path(dataset).is_file():
            ctx.log.info("the sweep measures on %s; a JSONL of your own prompts (speculative.sweep.dataset) measures "
                         "where speculation pays on your work", dataset)
        plan = levels.Plan(dataset=dataset, concurrency=spec.sweep.concurrency, requests=spec.sweep.requests,
                           min_duration_s=0, output_tokens=spec.sweep.output_tokens,
                           equal_levels=False)  # with against without at each level: no level compares with another
        with served(ctx, str(ctx.workdir), ctx.engine.model_copy(update={"speculative": None}), "sweep-without") as run:
            lengths = None if spec.sweep.output_tokens else levels.natural_lengths(
                run.server.url, run.running.served_name, str(ctx.workdir), plan)
            without = levels.measure(run.server.url, run.running.served_name, str(ctx.workdir), plan, lengths=lengths)
        ctx.progress(0.5)
        rows: list[SweepRow] = []
        with served(ctx, str(ctx.workdir), ctx.engine, "sweep-with") as run:
            for base in without:
                rows.append(sweep_row(base, levels.measure(run.server.url, run.running.served_name, str(ctx.workdir), plan,
                                                           lengths=lengths, only=base.concurrency)[0]))
                ctx.log.info("speculation against none, equal work: %s", _table(rows))
                if rows[-1].loses:
                    break
        sweep = Sweep(dataset=dataset, output_tokens=spec.sweep.output_tokens, requests_per_level=spec.sweep.requests,
                      levels=rows, first_losing_level=next((r.concurrency for r in rows if r.loses), None))
        ctx.metrics[self.section].sweep = sweep  # type: ignore[attr-defined]
        limit = switch_off_above(rows, dataset)
        if limit is not None:
            assert ctx.engine.speculative is not None
            ctx.engine = ctx.engine.model_copy(update={"speculative": ctx.engine.speculative.disabled_above(limit)})
            sweep.disable_above_batch = limit
            ctx.log.info("speculation switched off above batch %d", limit)
        ctx.progress(1.0)

    def verify(self, engine: EngineConfig, running: Running) -> engine_metrics.SpeculationStats | None:
        """A configuration that speculates must propose drafts, and have some accepted."""
        if engine.speculative is None:
            return None
        return engine_metrics.verify_speculation(running.url, running.served_name, running.headers)


TECHNIQUE = SpeculativeTechnique()


def sweep_dataset(sweep: SpeculationSweep, model: sources.Model) -> str:
    """The sweep's workload: as the recipe names it, or for 'auto' the catalogue's for the model."""
    if sweep.dataset != "auto":
        return sweep.dataset
    catalogued = catalog_id(model)
    return catalog.get(catalogued).sweep_dataset if catalogued else "builtin-qa"


def switch_off_above(rows: list[SweepRow], dataset: str) -> int | None:
    """The last level before the first that loses; None if none does. The lowest level keeps
    speculation if its loss is within the noise (the recipe asked for it, and one noisy level
    should not fail a job); a recipe whose speculation loses there beyond doubt fails: it would
    only cost."""
    losing = next((i for i, row in enumerate(rows) if row.loses), None)
    if losing == 0:
        first = rows[0]
        if not first.loses_outside_noise:
            return first.concurrency
        if first.acceptance_rate < 0.5:
            advice = (f"drafts are rarely accepted ({first.acceptance_rate:.2f}): draft with a model closer to the target, "
                      "use n-gram only where answers copy from the prompt, or sweep on a workload like yours "
                      "(speculative.sweep.dataset)")
        else:
            advice = (f"drafts are accepted ({first.acceptance_rate:.2f}) but proposing and verifying them costs more than "
                      "they save on this machine: quantize the draft (speculative.quantization), draft with a smaller "
                      "model, or serve without speculation")
        raise LlmoptError(f"speculation does not pay here: {_table(rows)} on {dataset}", advice)
    return None if losing is None else rows[losing - 1].concurrency


def _table(rows: list[SweepRow]) -> str:
    return ", ".join(
        f"c{r.concurrency} {r.speedup.value:.2f}x output tokens/s [{r.speedup.low:.2f}-{r.speedup.high:.2f}]"
        + (f" (decode {r.decode_speedup:.2f}x, TTFT {r.ttft_cost_ms:+.0f} ms, acceptance {r.acceptance_rate:.2f})"
           if r.decode_speedup is not None and r.ttft_cost_ms is not None else "")
        for r in rows)


def sweep_row(base: Level, spec: Level) -> SweepRow:
    """Speculation against none at one level, on equal work: the ratio with its interval, decode
    speed-up, TTFT cost and acceptance."""
    accepted = spec.speculative
    speedup = compare.throughput_ratio(spec, base, spec.output_tokens_per_s, base.output_tokens_per_s,
                                       lambda s: s.output_tokens, "higher", "equal work")
    if speedup is None:
        errors = {**base.errors, **spec.errors}
        raise LlmoptError(f"the sweep's requests at concurrency {base.concurrency} produced nothing"
                          + (f" ({next(iter(errors))})" if errors else ""), "read the engine logs of the sweep (sweep-*.log)")
    tpot = (base.tpot_ms.p50 / spec.tpot_ms.p50) if base.tpot_ms and spec.tpot_ms and spec.tpot_ms.p50 else None
    ttft = (spec.ttft_ms.p50 - base.ttft_ms.p50) if base.ttft_ms and spec.ttft_ms else None
    return SweepRow(concurrency=base.concurrency, output_tokens_per_s=round(spec.output_tokens_per_s, 2),
                    output_tokens_per_s_without=round(base.output_tokens_per_s, 2), speedup=speedup,
                    decode_speedup=round(tpot, 3) if tpot else None, ttft_cost_ms=round(ttft, 1) if ttft is not None else None,
                    acceptance_rate=round(accepted.acceptance_rate if accepted else 0.0, 3),
                    mean_accepted_length=round(accepted.mean_accepted_length if accepted else 0.0, 2))


def _check_draft(spec: DraftModel, ctx: CheckContext) -> Draft | None:
    """Same tokenizer vocabulary, and not larger than the target. The draft, if it resolves."""
    target = ctx.target
    try:
        resolved = resolve_draft(spec, target)
    except LlmoptError as exc:
        ctx.verdict.refusals.append(f"{exc.problem}; {exc.fix}")
        return None
    draft = resolved.model
    target_vocab, draft_vocab = _vocabulary(Path(target.path)), _vocabulary(Path(draft.path))
    if target_vocab != draft_vocab:
        differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        ctx.verdict.refusals.append(
            f"draft '{draft.id}' has a different tokenizer vocabulary from '{target.id}' "
            f"({len(draft_vocab)} against {len(target_vocab)} tokens, {differing} entries differ); "
            "use a draft from the same model family"
        )
    elif draft.size_bytes > target.size_bytes:
        ctx.verdict.refusals.append(
            f"draft '{draft.id}' ({draft.size_bytes / 1e6:.0f} MB) is larger than the target '{target.id}' "
            f"({target.size_bytes / 1e6:.0f} MB); use a smaller draft"
        )
    elif draft.content_hash == target.content_hash and resolved.quantization is None:
        ctx.verdict.warnings.append(f"draft '{draft.id}' is the target itself: speculation will be exact but cannot be faster")
    return resolved


def _config(model: sources.Model) -> dict[str, Any]:
    return json.loads((Path(model.path) / "config.json").read_text())


def _vocabulary(folder: Path) -> dict[str, int]:
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file():
        data = json.loads(tokenizer_json.read_text())
        raw = data["model"]["vocab"]
        vocab = {t[0]: i for i, t in enumerate(raw)} if isinstance(raw, list) else dict(raw)
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        return vocab
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(folder).get_vocab())

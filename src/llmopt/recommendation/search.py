"""A recommendation: run every candidate as an ordinary job (artifacts are reused by key), measure
each on equal work at every level with one deployment, rank for the goal, and keep the results as
deployment configurations. State is saved after each candidate, so a stopped run picks up where it
stopped: what is done is not run again.
"""

from __future__ import annotations

import importlib.metadata as md
import secrets
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt import hashing, locations, names, paths, roofline, sources
from llmopt.engine import platform, vllm
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError
from llmopt.evaluation import benchmark, levels, pricing
from llmopt.evaluation.levels import Plan
from llmopt.evaluation.pricing import HardwareProfile
from llmopt.evaluation.tokens import TokenCounter
from llmopt.jobs import runner, store
from llmopt.recipe import parse
from llmopt.recommendation import candidates as candidate_recipes
from llmopt.recommendation import calibration, configs
from llmopt.recommendation.candidates import Candidate, Excluded
from llmopt.recommendation.ranking import GOALS, SLO, Goal, Row, mark, pareto, pick, rank

Events = Callable[..., None]
SCHEMA_VERSION = 1
REFERENCE = "bf16"


class RecommendSpec(BaseModel):
    """What a recommendation measures, and what it optimizes for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    goal: Goal = "balanced"
    slos: tuple[SLO, ...] = ()
    max_quality_loss: float | None = Field(None, ge=0, le=10, description="Largest perplexity increase, as a fraction.")
    dataset: str = "builtin-qa"
    concurrency: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1)
    requests: int = Field(8, gt=0, le=100_000, description="Requests per level, the same prompts at every level (at least 4 per user of the highest).")
    min_duration_s: float = Field(10.0, ge=0, le=3600)
    budget_minutes: float | None = Field(None, gt=0)
    recipes: tuple[str, ...] = ()  # the user's own recipe files, tried as candidates too
    executor: str = Field("local", description="Where candidates' jobs run: local, or ray (all submitted at once).")
    ray_address: str | None = None

    @model_validator(mode="after")
    def _levels(self) -> "RecommendSpec":
        levels.check_rising(self.concurrency, "concurrency")
        return self

    def identity(self, source: sources.Model, hardware: Hardware, candidates: list[dict]) -> str:
        """What makes two runs the same run: the arguments that say what is measured (the goal, targets
        and budget only rank and choose), and what the measurements depend on besides: the model's
        and the recipe files' contents, the candidates tried, the machine, the engine, the build of
        its kernels and llmopt's release. A saved run is reused for none of those changed (a
        development build that tries another candidate keeps its release's version). `candidates`
        are the recipes `candidates.build` made for these arguments here."""
        measured = {
            "model": self.model, "plan": _plan(self).model_dump(mode="json"),  # how every level is loaded
            "content": source.content_hash,
            "recipes": [hashing.file_sha256(Path(r)) if Path(r).is_file() else r for r in self.recipes],
            "candidates": candidates,
            "hardware": hardware.model_dump(mode="json", include={"device", "cpu_model", "cpu_signature", "cores", "cpu_flags", "gpu", "gpu_count"}),
            "engine": vllm.engine_name_version(), "kernels": platform.kernels_build(hardware),
            "llmopt": md.version("llmopt"),
        }
        return hashing.json_sha256(measured)[:10]


class Recommendation(BaseModel):
    schema_version: int = SCHEMA_VERSION
    id: str
    spec: RecommendSpec
    hardware: Hardware
    price: HardwareProfile
    engine: str
    started_at: float
    finished_at: float | None = None
    candidates: list[Candidate]
    excluded: list[Excluded] = []
    lengths: dict[int, int] = {}  # the reference's output length per prompt: every candidate's equal work
    rows: list[Row] = []
    picks: dict[str, Row | None] = {}
    pareto_throughput: list[Row] = []  # tokens/s per user against total tokens/s
    pareto_price: list[Row] = []  # price per token against request latency

    @property
    def folder(self) -> Path:
        return paths.home() / "recommendations" / self.id

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        paths.write_atomic(self.folder / "recommendation.json", self.model_dump_json(indent=2))

    def ranked(self) -> list[Row]:
        return rank(self.rows, self.spec.goal)

    def deploy_command(self, goal: Goal) -> str | None:
        chosen = self.picks.get(goal)
        return f"llmopt deploy {self.spec.model} --config {chosen.candidate}" if chosen else None


def start(spec: RecommendSpec) -> Recommendation:
    """A recommendation for these arguments: the one already under way (or done) if there is one."""
    source = sources.resolve(spec.model)
    hardware = platform.detect()
    found, excluded = candidate_recipes.build(source, hardware, spec.concurrency, list(spec.recipes))
    run_id = f"{names.slug(source.id)[:40]}-{spec.identity(source, hardware, found)}"
    saved = paths.home() / "recommendations" / run_id / "recommendation.json"
    if saved.is_file():
        previous = Recommendation.model_validate_json(saved.read_text())
        if previous.finished_at is None:  # stopped: what is still to run is weighed as things stand; a finished run answers at once
            candidate_recipes.refresh_quantizing(previous.candidates, source, hardware)
            candidate_recipes.share_quantizing(previous.candidates, REFERENCE)
        return previous.model_copy(update={"spec": spec, "finished_at": None})
    plan = _plan(spec)
    level_requests = {c: plan.requests_at(c) or 0 for c in plan.concurrency}
    return Recommendation(
        id=run_id, spec=spec, hardware=hardware, price=pricing.for_hardware(hardware),
        engine=" ".join(vllm.engine_name_version()), started_at=time.time(), excluded=excluded,
        candidates=_candidates(found, source, hardware, level_requests, spec.min_duration_s),
    )


def _candidates(found: list[dict], source: sources.Model, hardware: Hardware, level_requests: dict[int, int],
                min_level_s: float) -> list[Candidate]:
    made, scale = [], calibration.scale(hardware)
    for c in found:
        quantize_s, weights = candidate_recipes.quantizing(c, source, hardware)
        made.append(Candidate(name=c["name"], recipe={k: v for k, v in c.items() if k != "name"}, quantize_s=quantize_s,
                              weights=weights, scale=scale,
                              base_s=candidate_recipes.estimate_seconds(c, source, hardware, level_requests, min_level_s)))
    candidate_recipes.share_quantizing(made, REFERENCE)
    return made


def fit_budget(rec: Recommendation) -> None:
    """Drop the most expensive candidates still to run until the run fits the budget (never the
    reference). What ran already counts by its estimate, so a resumed or repeated run drops the same
    candidates as the first and runs nothing more."""
    if rec.spec.budget_minutes is None:
        return
    for candidate in rec.candidates:
        if candidate.status == "dropped":
            candidate.status, candidate.reason = "pending", None
    budget = rec.spec.budget_minutes * 60
    while True:  # a dropped candidate that quantized hands its quantizing to the next that needs the weights
        candidate_recipes.share_quantizing(rec.candidates, REFERENCE)
        total = sum(c.estimate_s for c in rec.candidates if c.status in ("pending", "done", "failed"))
        pending = [c for c in rec.candidates if c.status == "pending" and c.name != REFERENCE]
        if total <= budget or not pending:
            return
        candidate = max(reversed(pending), key=lambda c: c.estimate_s)  # of equals, the later in preference
        candidate.status = "dropped"
        candidate.reason = f"about {candidate.estimate_s / 60:.0f} min does not fit the {rec.spec.budget_minutes:g}-minute budget"


def run(rec: Recommendation, events: Events = lambda *a, **k: None) -> Recommendation:
    """Every pending candidate in turn (the reference first), then the ranking; saved as it goes.

    With a cluster executor every candidate's job is submitted first, and all are built before the
    first is measured: the cluster builds side by side, and no build shares a core with a load test
    when this machine is one of its nodes."""
    plan = _plan(rec.spec)
    rec.save()
    pending = [c for c in sorted(rec.candidates, key=lambda c: c.name != REFERENCE) if c.status == "pending"]
    if rec.spec.executor != "local":
        for candidate in pending:
            try:
                _submit(rec, candidate)
            except LlmoptError as exc:
                _failed(candidate, exc)
        rec.save()
        submitted = [c for c in pending if c.status == "pending"]
        if submitted:
            events("building", jobs=[c.job for c in submitted], executor=rec.spec.executor)
        for candidate in submitted:
            if runner.Job(candidate.job or "").wait().status != store.COMPLETED and candidate.name == REFERENCE:
                _stop_builds(submitted[1:])  # nothing ranks without the reference; its measuring says why
                break
    for candidate in (c for c in pending if c.status == "pending"):
        events("candidate", name=candidate.name, estimate_s=candidate.estimate_s)
        started = time.monotonic()
        try:
            if rec.spec.executor == "local":
                _submit(rec, candidate)
            _measure(rec, candidate, plan, events)
            candidate.status = "done"
        except LlmoptError as exc:
            _failed(candidate, exc)
        candidate.seconds = round(time.monotonic() - started, 1)
        if candidate.status == "done" and rec.spec.executor == "local":  # a cluster's builds ran before, elsewhere
            calibration.record(rec.hardware, candidate.estimate_s / candidate.scale, candidate.seconds)
        rec.save()
    _rank(rec)
    rec.finished_at = time.time()
    rec.save()
    configs.save(rec.spec.model, deployment_configs(rec))
    return rec


def _plan(spec: RecommendSpec) -> Plan:
    return Plan(dataset=spec.dataset, concurrency=spec.concurrency, requests=spec.requests, min_duration_s=spec.min_duration_s)


def _failed(candidate: Candidate, exc: LlmoptError) -> None:
    """A candidate that failed is reported and the run goes on; without the reference nothing ranks."""
    if candidate.name == REFERENCE:
        raise exc
    candidate.status, candidate.reason = "failed", exc.one_line()


def _stop_builds(candidates: list[Candidate]) -> None:
    for candidate in candidates:
        try:
            if candidate.job and store.get(candidate.job).status in store.ACTIVE:
                runner.stop(candidate.job)
        except LlmoptError:
            continue  # ended meanwhile, or its cluster is not answering: it stays as it is


def _submit(rec: Recommendation, candidate: Candidate) -> None:
    """The candidate's job, through the spec's executor, unless a resumed run already has it
    (running, or built). One that ended without an artifact while no run watched it (its worker
    lost with the machine or the cluster, or stopped) is built again."""
    earlier = store.load(candidate.job) if candidate.job else None
    if earlier is None or earlier.status in (store.FAILED, store.STOPPED):
        job = runner.create(rec.spec.model, parse({"name": names.slug(candidate.name)[:30], **candidate.recipe}),
                            name=f"rec-{names.slug(candidate.name)[:40]}-{secrets.token_hex(3)}",
                            executor=rec.spec.executor, ray_address=rec.spec.ray_address)
        candidate.job = job.name
        rec.save()


def _measure(rec: Recommendation, candidate: Candidate, plan: Plan, events: Events) -> None:
    """The candidate's built job, then one deployment of its artifact loaded at every level on equal
    work (the reference first answers every prompt once, naturally, to set the lengths)."""
    record = runner.Job(candidate.job or "").wait().record
    if record.status != store.COMPLETED:
        raise LlmoptError(f"its job ended {record.status}: {record.failure_reason}", f"see `llmopt jobs logs {record.name}`")
    candidate.artifact = record.artifact
    manifest = locations.manifest(record.artifact or "")  # a reused artifact may be one a Ray job published to a URI
    price = rec.price
    rates = roofline.machine_rates()  # measured once per machine, before this deploy: no build runs beside it
    target = benchmark.deploy_target(record.artifact or "", events)
    try:
        counter = TokenCounter.from_path(target.result.tokenizer or "")
        work = plan.workload(counter)
        if not rec.lengths:
            rec.lengths = levels.natural_lengths_of(target.result.url, target.result.served_name, work, counter, plan,
                                                    target.headers, events)
        found = levels.run(target.result.url, target.result.served_name, work.with_lengths(rec.lengths), counter, plan, price,
                           target.headers, candidate.name, events)
    finally:
        target.deployed.stop()  # type: ignore[union-attr]
    aborted = next((level.aborted for level in found if level.aborted), None)
    if aborted:
        raise LlmoptError(f"its load test ended early: {aborted}", "see the endpoint's log")
    benchmark.decode_bounds(found, target.weights, target.result.engine, rates)
    result = target.result.model_copy(update={"equal_work": found})
    (rec.folder / "candidates").mkdir(parents=True, exist_ok=True)
    paths.write_atomic(rec.folder / "candidates" / f"{candidate.name}.json", result.model_dump_json(indent=2))
    metrics = manifest.metrics
    # position-wise, like the shipped configurations' rows, which were generated with it
    agreement = metrics.greedy_agreement.token_agreement if metrics.greedy_agreement else None
    rec.rows = [r for r in rec.rows if r.candidate != candidate.name] + [
        Row.of(candidate.name, level, metrics.perplexity_increase, agreement) for level in found]


def _rank(rec: Recommendation) -> None:
    mark(rec.rows, list(rec.spec.slos), rec.spec.max_quality_loss)
    rec.picks = {goal: pick(rec.rows, goal) for goal in GOALS}
    rec.pareto_throughput = pareto(rec.rows, "total_tokens_per_s", "tokens_per_s_per_user")
    rec.pareto_price = pareto(rec.rows, "latency_p90_ms", "blended_per_million", higher_x=False, higher_y=False)


def deployment_configs(rec: Recommendation) -> list[configs.DeploymentConfig]:
    """Each measured candidate as a deployment configuration, with the goals it won."""
    found = []
    for candidate in rec.candidates:
        rows = [r for r in rec.rows if r.candidate == candidate.name]
        if candidate.status != "done" or not rows:
            continue
        found.append(configs.DeploymentConfig(
            name=candidate.name, model=rec.spec.model, recipe=candidate.recipe, hardware=rec.hardware,
            price_profile=rec.price.name, picks=[g for g, r in rec.picks.items() if r is not None and r.candidate == candidate.name],
            rows=[configs.ConfigRow(concurrency=r.concurrency, ttft_p50_ms=r.ttft_p50_ms, tpot_p50_ms=r.tpot_p50_ms,
                                    tokens_per_s_per_user=r.tokens_per_s_per_user, total_tokens_per_s=r.total_tokens_per_s,
                                    price_per_hour=rec.price.effective_price_per_hour,
                                    blended_per_million=r.blended_per_million, perplexity_increase=r.perplexity_increase,
                                    greedy_agreement=r.greedy_agreement) for r in rows],
            engine=rec.engine, llmopt=md.version("llmopt"), measured_at=rec.finished_at or time.time(),
            dataset=rec.spec.dataset, source="measured", recommendation=rec.id))
    return found

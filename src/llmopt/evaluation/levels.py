"""Load one running server at each concurrency level of a plan: what an evaluation does per
target, and what a job needs to compare two engine settings side by side. Deploys nothing."""

from __future__ import annotations

import asyncio
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.errors import LlmoptError
from llmopt.evaluation import loadgen, metrics, pricing
from llmopt.evaluation import workload as workloads
from llmopt.evaluation.results import GoodputTargets, Level
from llmopt.evaluation.tokens import TokenCounter

Events = Callable[..., None]
MAX_LEVEL = 4096
REQUESTS_PER_USER = 4  # a level runs at least this many requests per concurrent user: more than one wave
MIN_DURATION_S = 30.0  # and, by default, at least this long: shorter levels gave ratios too noisy to trust


def check_rising(concurrency: tuple[int, ...], what: str) -> None:
    """Levels compare in order: each positive, rising, and once (a plan's, a sweep's, recommend's)."""
    if any(c <= 0 for c in concurrency) or list(concurrency) != sorted(set(concurrency)):
        raise ValueError(f"{what} must be increasing positive integers, got {list(concurrency)}")


class Plan(BaseModel):
    """The load of an evaluation: which requests, at which concurrency levels, for how long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = "builtin-qa"
    concurrency: tuple[int, ...] = Field((1, 4), min_length=1)
    requests: int | None = Field(16, gt=0, le=1_000_000,
                                 description="At least; never fewer than 4 per user (of the highest level, with equal_levels).")
    duration_s: float | None = Field(None, gt=0, le=7 * 86400, description="Seconds per level instead of a request count.")
    min_duration_s: float = Field(MIN_DURATION_S, ge=0, le=86400, description="With a request count: at least this long.")
    output_tokens: int | None = Field(None, gt=0, le=1 << 16,
                                      description="Every request generates exactly this many tokens (end-of-sequence ignored).")
    warmup_requests: int | None = Field(None, ge=0, le=10_000)
    equal_levels: bool = Field(True, description="Every level sends the same prompts, as many as the highest level needs, "
                                                 "so levels compare on equal work; off, a level sends only what it needs.")
    timeout_s: float = Field(loadgen.DEFAULT_TIMEOUT_S, gt=0, le=86400)
    seed: int = Field(0, ge=0)
    goodput: GoodputTargets = GoodputTargets()

    @model_validator(mode="after")
    def _levels(self) -> "Plan":
        if any(c <= 0 or c > MAX_LEVEL for c in self.concurrency):
            raise ValueError(f"concurrency levels must be from 1 to {MAX_LEVEL}, got {list(self.concurrency)}")
        check_rising(self.concurrency, "concurrency levels")
        return self

    def requests_at(self, concurrency: int) -> int | None:
        users = max(self.concurrency) if self.equal_levels else concurrency
        return None if self.duration_s is not None else max(self.requests or 0, REQUESTS_PER_USER * users)

    def first_request(self) -> int | None:
        """Where every level's measured prompts start, past the largest warm-up; None: past each level's own."""
        if not self.equal_levels:
            return None
        return self.warmup_requests if self.warmup_requests is not None else max(self.concurrency)

    def prompts_sent(self, available: int) -> int:
        """How many of a workload's first prompts the levels send, warm-ups included (a level past
        its minimum time repeats its own prompts; a timed level may cycle through all of them)."""
        if self.duration_s is not None:
            return available
        first = self.first_request()
        warmup = self.warmup_requests
        ends = ((first if first is not None else warmup if warmup is not None else c) + (self.requests_at(c) or 0)
                for c in self.concurrency)
        return min(available, max(ends))

    def workload(self, counter: TokenCounter | None) -> workloads.Workload:
        count = max(self.requests or 64, REQUESTS_PER_USER * max(self.concurrency)) + max(self.concurrency)  # + warm-up
        work = workloads.load(self.dataset, seed=self.seed, count=count, tokenizer=counter.tokenizer if counter else None)
        return work.fixed(self.output_tokens) if self.output_tokens else work


def run(url: str, served_name: str, work: workloads.Workload, counter: TokenCounter | None, plan: Plan,
        price: pricing.HardwareProfile, headers: dict[str, str] | None = None, label: str = "",
        events: Events = lambda *a, **k: None, only: int | None = None) -> list[Level]:
    """Every level of the plan in turn (or `only` that one, with the prompts the whole plan gives
    it); stops after a level that was aborted (the server went away)."""
    found = []
    for level in plan.concurrency if only is None else (only,):
        settings = loadgen.RunSettings(plan.requests_at(level), plan.duration_s, plan.warmup_requests, plan.timeout_s,
                                       0.0 if plan.duration_s is not None else plan.min_duration_s, plan.first_request())
        events("level", target=label, concurrency=level, total=plan.requests_at(level))
        run_ = asyncio.run(loadgen.run_level(url, served_name, work, level, settings, headers or {},
                                             on_done=lambda r: events("request", error=r.error)))
        computed = metrics.compute(run_, counter, price, plan.goodput, work)
        found.append(computed)
        events("level_done", target=label, level=computed)
        if run_.aborted:
            break
    return found


def output_lengths(found: list[Level]) -> dict[int, int]:
    """Each prompt's output length as a target generated it (the server's count, median over its
    runs): what an equal-work leg asks every target to generate."""
    runs: dict[int, list[int]] = {}
    for level in found:
        for sample in level.requests:
            runs.setdefault(sample.prompt, []).append(sample.served_tokens or sample.output_tokens)
    return {prompt: sorted(lengths)[len(lengths) // 2] for prompt, lengths in runs.items()}


def measure(url: str, served_name: str, tokenizer_path: str, plan: Plan, headers: dict[str, str] | None = None,
            lengths: dict[int, int] | None = None, only: int | None = None) -> list[Level]:
    """Throughput and latency at every level (or `only` that one), or an error if the server stopped
    answering. The prompts are the whole plan's at any level, so two runs of one plan send the same
    ones; with `lengths` (`natural_lengths` of another run) every prompt generates exactly what they
    give it: equal work with that run."""
    counter = TokenCounter.from_path(tokenizer_path)
    work = plan.workload(counter)
    return _completed(url, served_name, work if lengths is None else work.with_lengths(lengths), counter, plan, headers,
                      only=only)


def natural_lengths(url: str, served_name: str, tokenizer_path: str, plan: Plan,
                    headers: dict[str, str] | None = None) -> dict[int, int]:
    """Each prompt's natural output length on this server: one pass over every prompt the plan's
    levels send, at its highest level, no warm-up. What `measure(lengths=...)` replays, with
    end-of-sequence ignored (the lengths do not depend on the level at temperature 0)."""
    counter = TokenCounter.from_path(tokenizer_path)
    return natural_lengths_of(url, served_name, plan.workload(counter), counter, plan, headers)


def natural_lengths_of(url: str, served_name: str, work: workloads.Workload, counter: TokenCounter, plan: Plan,
                       headers: dict[str, str] | None = None, events: Events = lambda *a, **k: None) -> dict[int, int]:
    """`natural_lengths` for a caller that has already built the plan's workload and its tokenizer."""
    every = plan.model_copy(update={"concurrency": (max(plan.concurrency),), "requests": plan.prompts_sent(len(work.requests)),
                                    "duration_s": None, "min_duration_s": 0.0, "warmup_requests": 0})
    return output_lengths(_completed(url, served_name, work, counter, every, headers, "natural lengths", events))


def _completed(url: str, served_name: str, work: workloads.Workload, counter: TokenCounter, plan: Plan,
               headers: dict[str, str] | None, label: str = "", events: Events = lambda *a, **k: None,
               only: int | None = None) -> list[Level]:
    found = run(url, served_name, work, counter, plan, pricing.choose(None, None, None), headers, label, events, only)
    if aborted := next((level.aborted for level in found if level.aborted), None):
        raise LlmoptError(f"load test against {url} aborted: {aborted}", "see the engine log")
    return found

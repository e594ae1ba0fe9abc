"""Ranking measured candidates for a goal under service-level targets, and their Pareto fronts.

Every figure comes from the equal-work leg (the same prompts and output lengths on every
candidate), so a candidate that answers in fewer tokens is not mistaken for a faster one. A row is
one candidate at one concurrency level. Rows that miss a target stay in the table, marked.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel

from llmopt.errors import LlmoptError
from llmopt.evaluation.results import Level

Goal = Literal["latency", "throughput", "cost", "balanced"]
GOALS: tuple[Goal, ...] = ("latency", "throughput", "cost", "balanced")
SLO_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "latency_p90_ms", "min_tokens_per_s_per_user")


class SLO(BaseModel):
    """A service-level target: a metric and its bound (an upper bound, or a lower one for rates)."""

    metric: str
    bound: float

    @classmethod
    def parse(cls, text: str) -> "SLO":
        match = re.fullmatch(r"\s*([a-z0-9_]+)\s*=\s*([0-9.]+)\s*", text)
        if match is None or match.group(1) not in SLO_METRICS:
            raise LlmoptError(f"bad service-level target '{text}'", f"write METRIC=NUMBER with a metric of {', '.join(SLO_METRICS)}")
        return cls(metric=match.group(1), bound=float(match.group(2)))

    def met(self, row: "Row") -> bool:
        value = getattr(row, self.metric.removeprefix("min_"))
        if value is None:
            return False
        return value >= self.bound if self.metric.startswith("min_") else value <= self.bound


class Row(BaseModel):
    """One candidate at one level, on equal work; quality from its job's measurement."""

    candidate: str
    concurrency: int
    tokens_per_s_per_user: float
    total_tokens_per_s: float  # output tokens
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    latency_p90_ms: float | None
    blended_per_million: float | None
    perplexity_increase: float | None
    greedy_agreement: float | None
    accuracy: float | None
    acceptance_rate: float | None
    misses: list[str] = []  # the targets it misses, and a quality cost over the limit
    decode_vs_bound: float | None = None  # decode tokens/s over this machine's bound (evaluation DecodeBound)

    @classmethod
    def of(cls, candidate: str, level: Level, perplexity_increase: float | None, agreement: float | None) -> "Row":
        per_user = level.per_request.output_tokens_per_s
        return cls(
            candidate=candidate, concurrency=level.concurrency,
            tokens_per_s_per_user=per_user.mean if per_user else 0.0, total_tokens_per_s=level.output_tokens_per_s,
            requests_per_s=level.request_throughput_per_s,
            ttft_p50_ms=level.ttft_ms.p50 if level.ttft_ms else None, ttft_p90_ms=level.ttft_ms.p90 if level.ttft_ms else None,
            tpot_p50_ms=level.tpot_ms.p50 if level.tpot_ms else None, tpot_p90_ms=level.tpot_ms.p90 if level.tpot_ms else None,
            latency_p90_ms=level.latency_ms.p90 if level.latency_ms else None,
            decode_vs_bound=level.decode_bound.fraction if level.decode_bound else None,
            blended_per_million=level.price.blended_per_million_tokens, perplexity_increase=perplexity_increase,
            greedy_agreement=agreement, accuracy=level.accuracy.rate if level.accuracy else None,
            acceptance_rate=level.speculative.acceptance_rate if level.speculative else None)

    @property
    def eligible(self) -> bool:
        return not self.misses


def mark(rows: list[Row], slos: list[SLO], max_quality_loss: float | None) -> None:
    for row in rows:
        row.misses = [f"{s.metric} {'>=' if s.metric.startswith('min_') else '<='} {s.bound:g}" for s in slos if not s.met(row)]
        if max_quality_loss is not None and (row.perplexity_increase or 0.0) > max_quality_loss:
            row.misses.append(f"perplexity +{100 * (row.perplexity_increase or 0):.1f}% > {100 * max_quality_loss:.1f}%")


def score(row: Row, goal: Goal) -> float:
    """Higher is better, for every goal."""
    if goal == "latency":
        return row.tokens_per_s_per_user
    if goal == "throughput":
        return row.total_tokens_per_s
    if goal == "cost":
        return 1 / row.blended_per_million if row.blended_per_million else 0.0
    return math.sqrt(row.tokens_per_s_per_user * row.total_tokens_per_s)


def rank(rows: list[Row], goal: Goal) -> list[Row]:
    """Eligible rows first, best first; then the rows that miss a target, best first."""
    return sorted(rows, key=lambda r: (not r.eligible, -score(r, goal)))


def pick(rows: list[Row], goal: Goal) -> Row | None:
    ranked = rank(rows, goal)
    return ranked[0] if ranked and ranked[0].eligible else None


def pareto(rows: list[Row], x: str, y: str, higher_x: bool = True, higher_y: bool = True) -> list[Row]:
    """The rows no other row beats on both axes (ties on both kept once)."""
    def better(a: Row, b: Row) -> bool:
        ax, bx, ay, by = getattr(a, x), getattr(b, x), getattr(a, y), getattr(b, y)
        if None in (ax, bx, ay, by):
            return False
        ge_x = ax >= bx if higher_x else ax <= bx
        ge_y = ay >= by if higher_y else ay <= by
        return ge_x and ge_y and (ax, ay) != (bx, by)

    return [r for r in rows if getattr(r, x) is not None and getattr(r, y) is not None
            and not any(better(other, r) for other in rows)]

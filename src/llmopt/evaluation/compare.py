"""Comparisons between evaluated targets: each target against the first, per level, as ratios with
intervals, from the leg that measures what the ratio claims.

Throughput and price compare **equal work**: the reference's output lengths replayed on every
target with end-of-sequence ignored. Otherwise a model that answers in fewer tokens looks slower
in output tokens/s while it finishes the same requests sooner (a SmoothQuant artifact whose
answers averaged 24.6 tokens against 41.2 came out at 0.95x output tokens/s while it ran 1.58x
the requests/s). Latency (TTFT, time per output token, request latency) compares the natural leg.

Each ratio carries a 95% interval from a bootstrap over the prompts both sides ran, paired (on the
log scale, with Student's t for the few prompts a level has), widened to the noise between
deployments that a bootstrap within one run cannot see (`NOISE`); an interval that spans 1.0 is
no measurable difference.
"""

from __future__ import annotations

from typing import Callable, Literal

import numpy as np

from llmopt.evaluation import quality
from llmopt.evaluation.results import (
    Comparison, Level, LevelRatios, Ratio, RequestSample, Stats, TargetComparison, TargetResult,
)

BOOTSTRAP_ROUNDS = 1000
# Deployment-to-deployment spread of one target against itself (benchmarks/compare_noise.py: five
# deployments, every request prefilled as new, relative standard deviations 9.8% at concurrency 1
# and 5.9% at 4, on 2 AMD EPYC cores; 95% of the ratios of two deployments lie within 23.2% and
# 15.0%; 17.3% and 18.0% in the run before, with prompts repeated within a level cached): no
# interval is narrower than this on either side.
NOISE = 0.20


def _t975(df: int) -> float:
    """Student's t at 97.5% (Cornish-Fisher; within 0.1% of the table from 3 degrees of freedom up)."""
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _interval(point: float, ratios: np.ndarray, n: int) -> tuple[float, float]:
    """A 95% interval on the log scale: the bootstrap's spread, corrected for few requests (the
    plain percentile interval of a bootstrap is too narrow at the 8-30 requests of a level), and
    never narrower than the noise between deployments, on the log scale too: a ratio and its
    reciprocal (throughput and price per token) get reciprocal intervals, so both say the same."""
    low = high = point
    if len(ratios) and n > 2:
        spread = float(np.std(np.log(ratios))) * (n / (n - 1)) ** 0.5 * _t975(n - 1)
        low, high = point * float(np.exp(-spread)), point * float(np.exp(spread))
    return min(low, point * (1 - NOISE)), max(high, point / (1 - NOISE))


def _per_prompt(level: Level, prompts: list[int], value: Callable[[RequestSample], float | None],
                reduce: Callable[[list[float]], float]) -> np.ndarray:
    """One figure per prompt (its requests' values reduced), in the order of `prompts`."""
    found: dict[int, list[float]] = {}
    for sample in level.requests:
        v = value(sample)
        if v is not None:
            found.setdefault(sample.prompt, []).append(v)
    return np.array([reduce(found[p]) for p in prompts])


def _prompts(mine: Level, ref: Level, value: Callable[[RequestSample], float | None]) -> list[int]:
    """The prompts both levels completed: the two sides of an equal comparison, resampled together."""
    def having(level: Level) -> set[int]:
        return {s.prompt for s in level.requests if value(s) is not None}

    return sorted(having(mine) & having(ref))


def throughput_ratio(mine: Level, ref: Level, value: float, ref_value: float, weight: Callable[[RequestSample], float],
                     better: Literal["higher", "lower"], leg: Literal["natural", "equal work"]) -> Ratio | None:
    """The measured ratio; its interval from a bootstrap over the prompts both sides ran (paired:
    how hard each prompt is cancels out), of Little's-law rates: a closed loop of `concurrency`
    users, each request taking its latency, makes concurrency x weight / latency a second."""
    if value <= 0 or ref_value <= 0:
        return None
    measured = value / ref_value
    prompts = _prompts(mine, ref, lambda s: s.latency_ms)
    ratios = np.array([])
    if len(prompts) > 2:
        rng = np.random.default_rng(0)
        picks = rng.integers(0, len(prompts), size=(BOOTSTRAP_ROUNDS, len(prompts)))
        sides = []
        for level in (mine, ref):
            w = _per_prompt(level, prompts, weight, lambda v: float(np.mean(v)))
            lat = _per_prompt(level, prompts, lambda s: s.latency_ms / 1000, lambda v: float(np.mean(v)))
            sides.append((level.concurrency * w[picks].sum(axis=1) / np.maximum(lat[picks].sum(axis=1), 1e-12),
                          level.concurrency * w.sum() / max(lat.sum(), 1e-12)))
        (boot_mine, full_mine), (boot_ref, full_ref) = sides
        ratios = (boot_mine / boot_ref) / (full_mine / full_ref) * measured
    if better == "lower":  # price is the inverse of tokens/s
        measured, ratios = 1 / measured, 1 / ratios
    low, high = _interval(measured, ratios, len(prompts))
    return Ratio(value=measured, low=low, high=high, leg=leg, better=better)


def latency_ratio(mine: Level, ref: Level, stats: Callable[[Level], Stats | None], field: str) -> Ratio | None:
    """The ratio of medians (lower is better); its interval from a paired bootstrap over prompts
    of the medians of each prompt's values."""
    mine_stats, ref_stats = stats(mine), stats(ref)
    if mine_stats is None or ref_stats is None or ref_stats.p50 <= 0:
        return None
    point = mine_stats.p50 / ref_stats.p50
    value: Callable[[RequestSample], float | None] = lambda s: getattr(s, field)  # noqa: E731
    prompts = _prompts(mine, ref, value)
    ratios = np.array([])
    if len(prompts) > 2:
        rng = np.random.default_rng(0)
        picks = rng.integers(0, len(prompts), size=(BOOTSTRAP_ROUNDS, len(prompts)))
        a, b = (_per_prompt(level, prompts, value, lambda v: float(np.median(v))) for level in (mine, ref))
        ratios = np.median(a[picks], axis=1) / np.maximum(np.median(b[picks], axis=1), 1e-12)
        ratios *= point / (float(np.median(a)) / max(float(np.median(b)), 1e-12))
    low, high = _interval(point, ratios, len(prompts))
    return Ratio(value=point, low=low, high=high, leg="natural", better="lower")


def _level(natural: Level, ref_natural: Level, work: Level | None, ref_work: Level | None) -> LevelRatios:
    equal = work is not None and ref_work is not None
    w, rw = (work, ref_work) if equal else (natural, ref_natural)
    leg: Literal["natural", "equal work"] = "equal work" if equal else "natural"
    assert w is not None and rw is not None
    return LevelRatios(
        concurrency=natural.concurrency,
        output_tokens_per_s=throughput_ratio(w, rw, w.output_tokens_per_s, rw.output_tokens_per_s,
                                             lambda s: s.output_tokens, "higher", leg),
        requests_per_s=throughput_ratio(w, rw, w.request_throughput_per_s, rw.request_throughput_per_s, lambda s: 1.0, "higher", leg),
        total_tokens_per_s=throughput_ratio(w, rw, w.total_tokens_per_s, rw.total_tokens_per_s,
                                            lambda s: s.input_tokens + s.output_tokens, "higher", leg),
        blended_price=throughput_ratio(w, rw, w.total_tokens_per_s, rw.total_tokens_per_s,
                                       lambda s: s.input_tokens + s.output_tokens, "lower", leg),
        ttft_p50=latency_ratio(natural, ref_natural, lambda lv: lv.ttft_ms, "ttft_ms"),
        tpot_p50=latency_ratio(natural, ref_natural, lambda lv: lv.tpot_ms, "tpot_ms"),
        latency_p50=latency_ratio(natural, ref_natural, lambda lv: lv.latency_ms, "latency_ms"),
    )


def compare(targets: list[TargetResult]) -> Comparison:
    """Each target against the first: throughput, latency, price and quality ratios per level."""
    reference = targets[0]
    natural = {level.concurrency: level for level in reference.levels}
    equal = {level.concurrency: level for level in reference.equal_work}
    ref_quality = reference.quality
    rows = []
    for target in targets[1:]:
        mine_equal = {level.concurrency: level for level in target.equal_work}
        row = TargetComparison(label=target.label, reference=reference.label, levels=[
            _level(level, natural[level.concurrency], mine_equal.get(level.concurrency), equal.get(level.concurrency))
            for level in target.levels if level.concurrency in natural])
        mine = target.quality
        if mine and ref_quality and mine.perplexity and ref_quality.perplexity:
            row.perplexity_ratio = mine.perplexity.perplexity / ref_quality.perplexity.perplexity
        if mine and ref_quality and mine.greedy_tokens and ref_quality.greedy_tokens:
            row.greedy_agreement = quality.agreement(ref_quality.greedy_tokens, mine.greedy_tokens, mine.forced_token_agreement)
        ref_acc = reference.levels[0].accuracy if reference.levels else None
        acc = target.levels[0].accuracy if target.levels else None
        if ref_acc and acc:
            row.accuracy_change = acc.rate - ref_acc.rate
        rows.append(row)
    return Comparison(reference=reference.label, targets=rows)

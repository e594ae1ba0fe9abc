"""Comparisons between evaluated targets: each target's figures over the first target's, per level."""

from __future__ import annotations

from llmopt.evaluation import quality
from llmopt.evaluation.results import Comparison, Level, LevelRatios, Stats, TargetComparison, TargetResult


def _p50(stats: Stats | None) -> float | None:
    return stats.p50 if stats else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference not in (None, 0) else None


def _level(level: Level, ref: Level) -> LevelRatios:
    return LevelRatios(
        concurrency=level.concurrency,
        output_tokens_per_s=_ratio(level.output_tokens_per_s, ref.output_tokens_per_s),
        ttft_p50=_ratio(_p50(level.ttft_ms), _p50(ref.ttft_ms)),
        itl_p50=_ratio(_p50(level.itl_ms), _p50(ref.itl_ms)),
        latency_p50=_ratio(_p50(level.latency_ms), _p50(ref.latency_ms)),
        blended_price=_ratio(level.price.blended_per_million_tokens, ref.price.blended_per_million_tokens),
    )


def compare(targets: list[TargetResult]) -> Comparison:
    """Each target against the first: throughput, latency, price and quality ratios per level."""
    reference = targets[0]
    by_level = {level.concurrency: level for level in reference.levels}
    ref_quality = reference.quality
    rows = []
    for target in targets[1:]:
        row = TargetComparison(label=target.label, reference=reference.label,
                               levels=[_level(lvl, by_level[lvl.concurrency]) for lvl in target.levels if lvl.concurrency in by_level])
        mine = target.quality
        if mine and ref_quality and mine.perplexity and ref_quality.perplexity:
            row.perplexity_ratio = mine.perplexity.perplexity / ref_quality.perplexity.perplexity
        if mine and ref_quality and mine.greedy_tokens and ref_quality.greedy_tokens:
            row.greedy_agreement = quality.agreement(ref_quality.greedy_tokens, mine.greedy_tokens)
        ref_acc = reference.levels[0].accuracy if reference.levels else None
        acc = target.levels[0].accuracy if target.levels else None
        if ref_acc and acc:
            row.accuracy_change = acc.rate - ref_acc.rate
        rows.append(row)
    return Comparison(reference=reference.label, targets=rows)

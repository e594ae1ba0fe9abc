"""The main job's verdict: one line saying what an optimization bought and what it cost."""

from __future__ import annotations

from llmopt.evaluation.results import EvaluationResults


def verdict(results: EvaluationResults) -> str:
    """The optimized target against the original: throughput per level, price and quality."""
    assert results.comparison is not None
    row = results.comparison.targets[0]
    speed = ", ".join(f"{lvl.output_tokens_per_s:.2f}x output tokens/s at concurrency {lvl.concurrency}"
                      for lvl in row.levels if lvl.output_tokens_per_s is not None)
    busiest = row.levels[-1]
    parts = [f"{row.label} against {row.reference}: {speed}"]
    if busiest.blended_price is not None:
        parts.append(f"{busiest.blended_price:.2f}x the price per token at concurrency {busiest.concurrency}")
    if row.perplexity_ratio is not None:
        parts.append(f"perplexity {100 * (row.perplexity_ratio - 1):+.1f}%")
    if row.greedy_agreement is not None:
        parts.append(f"{row.greedy_agreement.token_agreement:.0%} of greedy tokens agree")
    return "; ".join(parts)

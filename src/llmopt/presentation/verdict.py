"""The main job's verdict: what an optimization bought (faster per token, more requests on equal
work, cheaper per token on equal work) and what it cost (perplexity, greedy agreement), each
figure with the leg it comes from and its interval."""

from __future__ import annotations

from llmopt.evaluation.results import EvaluationResults
from llmopt.presentation.format import ratio


def verdict(results: EvaluationResults) -> str:
    assert results.comparison is not None
    row = results.comparison.targets[0]
    first, busiest = row.levels[0], row.levels[-1]
    parts = [f"{row.label} against {row.reference}: time per output token {ratio(first.tpot_p50)} at concurrency "
             f"{first.concurrency} (natural outputs)"]
    leg = first.requests_per_s.leg if first.requests_per_s else "natural"
    parts.append(f"requests/s on {leg} " + ", ".join(f"{ratio(lvl.requests_per_s, 'more', 'fewer')} at concurrency {lvl.concurrency}"
                                                     for lvl in row.levels))
    parts.append(f"price per token on {leg} {ratio(busiest.blended_price, 'cheaper', 'dearer')} at concurrency {busiest.concurrency}")
    if row.perplexity_ratio is not None:
        parts.append(f"perplexity {100 * (row.perplexity_ratio - 1):+.1f}%")
    if row.greedy_agreement is not None:
        agreed = row.greedy_agreement
        if agreed.forced_token_agreement is None:
            parts.append(f"{agreed.token_agreement:.0%} of greedy tokens agree")
        else:
            parts.append(f"{agreed.forced_token_agreement:.0%} of the reference's greedy tokens ranked first too, given its "
                         f"answer so far ({agreed.token_agreement:.0%} of positions agree between the free-running answers)")
    return "; ".join(parts)

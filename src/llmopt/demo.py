"""`llmopt demo`, the main job on the default model: optimize it (SmoothQuant W8A8 by default, the
recipe that pays most on CPU), then load both the original and the artifact, side by side on the
real engine, and say in one line what the recipe bought and what it cost."""

from __future__ import annotations

from typing import Any

CONCURRENCY = (1, 4)


def verdict(results: dict[str, Any]) -> str:
    """The optimized target against the original: throughput per level, price and quality."""
    row = results["comparison"]["targets"][0]
    speed = ", ".join(f"{lvl['output_tokens_per_s']:.2f}x output tokens/s at concurrency {lvl['concurrency']}"
                      for lvl in row["levels"])
    busiest = row["levels"][-1]
    parts = [f"{row['label']} against {row['reference']}: {speed}",
             f"{busiest['blended_price']:.2f}x the price per token at concurrency {busiest['concurrency']}"]
    if "perplexity_ratio" in row:
        parts.append(f"perplexity {100 * (row['perplexity_ratio'] - 1):+.1f}%")
    if "greedy_agreement" in row:
        parts.append(f"{row['greedy_agreement']['token_agreement']:.0%} of greedy tokens agree")
    return "; ".join(parts)

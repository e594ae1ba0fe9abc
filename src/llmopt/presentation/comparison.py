"""The comparison table, the same in the terminal, the report and the studio: each ratio as a
speed-up or a slow-down with its interval, and the leg it was measured on."""

from __future__ import annotations

from typing import Callable

from llmopt.evaluation.results import Comparison, LevelRatios, Ratio
from llmopt.presentation.format import pct, ratio, times

COLUMNS: tuple[tuple[str, Callable[[LevelRatios], Ratio | None], str, str], ...] = (
    ("requests/s", lambda lvl: lvl.requests_per_s, "more", "fewer"),
    ("output tok/s", lambda lvl: lvl.output_tokens_per_s, "more", "fewer"),
    ("total tok/s", lambda lvl: lvl.total_tokens_per_s, "more", "fewer"),
    ("price per token", lambda lvl: lvl.blended_price, "cheaper", "dearer"),
    ("TTFT p50", lambda lvl: lvl.ttft_p50, "faster", "slower"),
    ("time per output token p50", lambda lvl: lvl.tpot_p50, "faster", "slower"),
    ("request latency p50", lambda lvl: lvl.latency_p50, "faster", "slower"),
)
NOTE = ("Throughput and price compare equal work: the reference's output lengths replayed on every target, "
        "end-of-sequence ignored. Latency compares the natural outputs. [low-high] is a 95% interval "
        "(bootstrap over requests, never narrower than the noise between deployments).")


def table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """The header and rows: a row per target and level."""
    legs = {r.leg for row in comparison.targets for lvl in row.levels for r in (lvl.requests_per_s,) if r is not None}
    throughput_leg = "equal work" if legs == {"equal work"} else "natural"
    head = ["target", "concurrency"] + [
        f"{name} ({throughput_leg if i < 4 else 'natural'})" for i, (name, _, _, _) in enumerate(COLUMNS)
    ] + ["perplexity", "greedy agreement (free-running)", "greedy agreement (teacher-forced)"]
    rows = []
    for row in comparison.targets:
        agreed = row.greedy_agreement
        for lvl in row.levels:
            rows.append([row.label, str(lvl.concurrency), *(ratio(pick(lvl), better, worse) for _, pick, better, worse in COLUMNS),
                         times(row.perplexity_ratio), pct(agreed.token_agreement if agreed else None),
                         pct(agreed.forced_token_agreement if agreed else None)])
    return head, rows

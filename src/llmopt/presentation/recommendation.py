"""A recommendation as people read it: the estimates, the ranked table (targets missed shown and
marked), the Pareto fronts drawn, and the pick with the command that deploys it."""

from __future__ import annotations

import time
from html import escape
from pathlib import Path

from rich.console import Console

from llmopt.recommendation.ranking import Row, score
from llmopt.recommendation.search import Recommendation
from llmopt.presentation import charts, report, terminal
from llmopt.presentation.format import money, num, pct

HEAD = ["candidate", "concurrency", "tok/s per user", "tok/s total", "TTFT p50/p90 ms", "TPOT p50/p90 ms", "decode vs bound",
        "$ per 1M (blended)", "perplexity", "greedy agreement", "accuracy", "acceptance", "misses"]
REPORT_FILE, RESULTS_FILE = "report.html", "recommendation.json"


def _pair(a: float | None, b: float | None) -> str:
    return "" if a is None else f"{a:.1f} / {b:.1f}" if b is not None else f"{a:.1f}"


def cells(row: Row) -> list[str]:
    return [row.candidate, str(row.concurrency), num(row.tokens_per_s_per_user), num(row.total_tokens_per_s),
            _pair(row.ttft_p50_ms, row.ttft_p90_ms), _pair(row.tpot_p50_ms, row.tpot_p90_ms), pct(row.decode_vs_bound, 0),
            money(row.blended_per_million),
            "" if row.perplexity_increase is None else f"{100 * row.perplexity_increase:+.1f}%", pct(row.greedy_agreement),
            pct(row.accuracy), "" if row.acceptance_rate is None else f"{row.acceptance_rate:.2f}", "; ".join(row.misses)]


def estimates(rec: Recommendation, console: Console) -> None:
    rows = [[c.name, ", ".join(k for k in c.recipe if k != "name") or "(as it is)", f"{c.estimate_s / 60:.1f}", c.status,
             c.reason or ""] for c in rec.candidates]
    rows += [[e.technique, "", "", "left out", e.reason] for e in rec.excluded]
    terminal.listing(console, f"Candidates for {rec.spec.model} (estimated minutes on this machine)",
                     ["candidate", "techniques", "minutes", "status", "note"], rows)


def table(rec: Recommendation, console: Console) -> None:
    goal = rec.spec.goal
    terminal.listing(console, f"Ranked for {goal} (equal work on {rec.spec.dataset}; {rec.price.name} at "
                     f"${rec.price.effective_price_per_hour}/h)", HEAD, [cells(r) for r in rec.ranked()])
    failed = [c for c in rec.candidates if c.status in ("failed", "dropped")]
    for candidate in failed:
        console.print(f"{candidate.name}: {candidate.status}: {candidate.reason}")
    console.print("Pareto front, tokens/s per user against total tokens/s: "
                  + ", ".join(f"{r.candidate}@{r.concurrency}" for r in rec.pareto_throughput))
    console.print("Pareto front, price against request latency p90: "
                  + ", ".join(f"{r.candidate}@{r.concurrency}" for r in rec.pareto_price))
    chosen = rec.picks.get(goal)
    if chosen is None:
        console.print(f"[red]no candidate meets every target for {goal}[/]; the table shows what each misses")
        return
    console.print(f"pick for {goal}: [bold]{chosen.candidate}[/] at concurrency {chosen.concurrency} "
                  f"({score(chosen, goal):.2f} by the goal's measure); deploy it with: {rec.deploy_command(goal)}")


def pareto_charts(rec: Recommendation) -> list[str]:
    """Both Pareto fronts, drawn (the report's and the studio's)."""
    label = lambda r: f"{r.candidate}@{r.concurrency}"  # noqa: E731
    return [
        charts.scatter_chart(
            "Tokens/s per user against total tokens/s", "total output tokens/s", "output tokens/s per user",
            {label(r): (r.total_tokens_per_s, r.tokens_per_s_per_user) for r in rec.rows},
            [label(r) for r in sorted(rec.pareto_throughput, key=lambda r: r.total_tokens_per_s)]),
        charts.scatter_chart(
            "Price against latency", "request latency p90 (ms)", "$ per 1M tokens (blended)",
            {label(r): (r.latency_p90_ms, r.blended_per_million) for r in rec.rows if r.latency_p90_ms and r.blended_per_million},
            [label(r) for r in sorted(rec.pareto_price, key=lambda r: r.latency_p90_ms or 0)]),
    ]


def html(rec: Recommendation) -> str:
    throughput, price = pareto_charts(rec)
    body = "".join("<tr" + (' class="miss"' if r.misses else "") + ">" + "".join(f"<td>{escape(c)}</td>" for c in cells(r)) + "</tr>"
                   for r in rec.ranked())
    chosen = rec.picks.get(rec.spec.goal)
    pick = (f"<p><b>Pick for {escape(rec.spec.goal)}:</b> {escape(chosen.candidate)} at concurrency {chosen.concurrency}. "
            f"Deploy it with <code>{escape(rec.deploy_command(rec.spec.goal) or '')}</code></p>") if chosen else \
        "<p class='warn'>No candidate meets every target.</p>"
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.finished_at or rec.started_at))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmopt recommendation</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }} th, td {{ border: 1px solid #ccc; padding: 4px 8px; }}
tr.miss td {{ color: #999; }} .warn {{ color: #b00; }} .charts {{ display: flex; gap: 12px; flex-wrap: wrap; }}</style>
</head><body><h1>Recommendation for {escape(rec.spec.model)}</h1>
<p>{escape(created)} · {escape(rec.hardware.cpu_model)} ({rec.hardware.cores} cores) · {escape(rec.engine)} ·
workload {escape(rec.spec.dataset)}, equal work · price {escape(rec.price.name)} ${rec.price.effective_price_per_hour}/h</p>
{pick}<div class="charts">{throughput}{price}</div>
<table><tr>{''.join(f'<th>{escape(h)}</th>' for h in HEAD)}</tr>{body}</table></body></html>"""


def write(rec: Recommendation, output: Path) -> None:
    report.save(output, {RESULTS_FILE: rec.model_dump_json(indent=2), REPORT_FILE: html(rec)})

"""A recommendation as people read it: the estimates, the ranked table (targets missed shown and
marked), the Pareto fronts drawn, and the pick with the command that deploys it."""

from __future__ import annotations

import json
import time
from html import escape
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmopt.recommendation.configs import DeploymentConfig
from llmopt.recommendation.ranking import Row, score
from llmopt.recommendation.search import Recommendation
from llmopt.presentation import charts, report, terminal
from llmopt.presentation.format import money, num, pct, when

HEAD = ["candidate", "conc", "tok/s per user", "tok/s total", "TTFT p50/p90 ms", "TPOT p50/p90 ms", "decode vs bound",
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


CONFIG_ROW_HEAD = ["conc", "TTFT p50 ms", "TPOT p50 ms", "tok/s per user", "tok/s total", "$/hour", "$ per 1M"]


def recipe_line(recipe: dict) -> str:
    """A recipe on one line, each section with its method and the settings it changes, e.g.
    'quantization smoothquant ignore=[], speculative ngram num_speculative_tokens=2'."""
    parts = []
    for section, body in recipe.items():
        if section == "name":
            continue
        settings = body if isinstance(body, dict) else {"": body}
        method = settings.get("method")
        words = [section] + ([str(method)] if method else [])
        words += [f"{key}={json.dumps(value)}" if key else json.dumps(value) for key, value in settings.items() if key != "method"]
        parts.append(" ".join(words))
    return ", ".join(parts) or "no techniques (the model as given)"


def _quality(config: DeploymentConfig) -> str:
    """A configuration's quality cost, the same at every level it was measured at (one artifact)."""
    first = config.rows[0] if config.rows else None
    if first is None or first.perplexity_increase is None:
        return "quality: the model's own"
    agreement = f", greedy agreement {pct(first.greedy_agreement)}" if first.greedy_agreement is not None else ""
    return f"perplexity {100 * first.perplexity_increase:+.1f}%{agreement}"


def configurations(found: list[DeploymentConfig], console: Console) -> None:
    """A table per configuration: its name (what `deploy --config` takes), then what holds for all
    its rows (recipe, machine, versions, date, quality), then a row per concurrency level. One row
    of every field, as the JSON has it, took 16 columns and read at 80 only with each folded to a
    character or two."""
    for config in found:
        picked = f"; picked for {', '.join(config.picks)}" if config.picks else ""
        table = Table(title=f"[bold]{config.name}[/] ({config.source}{picked})", title_justify="left",
                      caption=f"{recipe_line(config.recipe)} · {config.hardware.cpu_label} ({config.hardware.cores} cores) · {_quality(config)} · "
                              f"{config.engine}, llmopt {config.llmopt} · measured {when(config.measured_at)}",
                      caption_justify="left")
        for column in CONFIG_ROW_HEAD:
            table.add_column(column, justify="right")
        for row in config.rows:
            table.add_row(str(row.concurrency), num(row.ttft_p50_ms), num(row.tpot_p50_ms), num(row.tokens_per_s_per_user),
                          num(row.total_tokens_per_s), f"${row.price_per_hour:.4f}", money(row.blended_per_million))
        console.print(table)


def estimates(rec: Recommendation, console: Console) -> None:
    rows = [[c.name, recipe_line(c.recipe), f"{c.estimate_s / 60:.1f}", c.status, c.reason or ""] for c in rec.candidates]
    rows += [[e.technique, "", "", "left out", e.reason] for e in rec.excluded]
    scale = rec.candidates[0].scale if rec.candidates else 1.0
    timed = f", scaled by {scale:g} from the candidates timed here before" if scale != 1.0 else ""
    terminal.listing(console, f"Candidates for {rec.spec.model} (estimated minutes on this machine{timed})",
                     ["candidate", "recipe", "minutes", "status", "note"], rows)


def table(rec: Recommendation, console: Console) -> None:
    goal = rec.spec.goal
    terminal.listing(console, f"Ranked for {goal} (equal work on {rec.spec.dataset}; {rec.price.name} at "
                     f"${rec.price.effective_price_per_hour}/h)", HEAD, [cells(r) for r in rec.ranked()], keys=2)
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
<p>{escape(created)} · {escape(rec.hardware.cpu_label)} ({rec.hardware.cores} cores) · {escape(rec.engine)} ·
workload {escape(rec.spec.dataset)}, equal work · price {escape(rec.price.name)} ${rec.price.effective_price_per_hour}/h</p>
{pick}<div class="charts">{throughput}{price}</div>
<table><tr>{''.join(f'<th>{escape(h)}</th>' for h in HEAD)}</tr>{body}</table></body></html>"""


def write(rec: Recommendation, output: Path) -> None:
    report.save(output, {RESULTS_FILE: rec.model_dump_json(indent=2), REPORT_FILE: html(rec)})

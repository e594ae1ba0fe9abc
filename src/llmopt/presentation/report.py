"""An evaluation as files: `results.json` for machines and a self-contained `report.html` for people."""

from __future__ import annotations

import time
from html import escape
from pathlib import Path
from typing import Callable

from llmopt import paths
from llmopt.evaluation.results import Comparison, EvaluationResults, Level, Stats, TargetResult
from llmopt.presentation import charts, comparison
from llmopt.presentation.format import bound, cached, money, num

RESULTS_FILE, REPORT_FILE = "results.json", "report.html"


def write(results: EvaluationResults, output: Path) -> None:
    save(output, {RESULTS_FILE: results.model_dump_json(indent=2), REPORT_FILE: html(results)})


def save(output: Path, files: dict[str, str]) -> None:
    """Files of a run's output folder, each replaced whole: a reader never sees one half-written."""
    output.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        paths.write_atomic(output / name, text)


def _p50(stats: Stats | None) -> float | None:
    return stats.p50 if stats else None


def level_charts(targets: list[TargetResult]) -> list[str]:
    """Latency, throughput and price against concurrency, one line per target (the report's and the studio's)."""

    def series(pick: Callable[[Level], float | None]) -> dict[str, list[tuple[float, float | None]]]:
        return {t.label: [(lvl.concurrency, pick(lvl)) for lvl in t.levels] for t in targets}

    return [
        charts.line_chart("Time to first token (p50)", "concurrency", "ms", series(lambda l: _p50(l.ttft_ms)), True),
        charts.line_chart("Time per output token (p50)", "concurrency", "ms", series(lambda l: _p50(l.tpot_ms)), True),
        charts.line_chart("Client latency (p50)", "concurrency", "ms", series(lambda l: _p50(l.latency_ms)), True),
        charts.line_chart("Output throughput", "concurrency", "tokens/s", series(lambda l: l.output_tokens_per_s), True),
        charts.line_chart("Blended price (3:1 in:out)", "concurrency", "$ per 1M tokens",
                          series(lambda l: l.price.blended_per_million_tokens), True),
    ]


def distribution_charts(targets: list[TargetResult]) -> list[str]:
    return [
        charts.cdf_chart(title, "ms", {f"{t.label} @{lvl.concurrency}": pick(lvl) for t in targets for lvl in t.levels})
        for title, pick in (("TTFT distribution", lambda l: l.samples.ttft_ms), ("ITL distribution", lambda l: l.samples.itl_ms))
    ]


def html(results: EvaluationResults) -> str:
    targets = results.targets
    sections = [f"<h2>{escape(t.label)}</h2>{level_table(t)}{_quality_html(t)}" for t in targets]
    comparison = comparison_table(results.comparison) if results.comparison else ""
    price = results.price
    workload = results.workload
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(results.created_at))
    described = (f"workload <b>{escape(workload.name)}</b> ({workload.requests} requests, temperature {workload.temperature}, "
                 f"seed {workload.seed})") if workload else "no workload"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmopt evaluation</title>
<style>{STYLE}</style></head><body>
<h1>llmopt evaluation</h1>
<p class="meta">{escape(created)} · {described}
 · price: {escape(price.name)} ${price.price_per_hour}/h, discount {price.discount:.0%} (as of {escape(price.as_of)})
 · schema version {results.schema_version}</p>
{comparison}
<h2>Latency, throughput and price by concurrency</h2><div class="charts">{''.join(level_charts(targets))}</div>
<h2>Distributions</h2><div class="charts">{''.join(distribution_charts(targets))}</div>
{''.join(sections)}
</body></html>"""


STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; } .meta { color: #555; font-size: 13px; }
.warn { color: #b00; } .wide { overflow-x: auto; }
"""


def _table(head: tuple[str, ...], rows: list[tuple[object, ...]]) -> str:
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return '<div class="wide"><table><tr>' + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>" + body + "</table></div>"


def level_table(target: TargetResult) -> str:
    head = ("concurrency", "invocations", "errors", "tokenizer failures", "empty", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
            "ITL p50/p90/p99 ms", "latency p50/p90/p99 ms", "in tok/s", "out tok/s", "req/s", "in tok/s/req", "out tok/s/req",
            "in tokens/req", "out tokens/req", "$/1M in", "$/1M out", "$/1M blended", "goodput req/s", "acceptance",
            "prompt tokens prefix-cached", "decode vs bound tok/s")
    rows = []
    for lvl in target.levels:
        spec, per = lvl.speculative, lvl.per_request
        rows.append((lvl.concurrency, lvl.invocations, lvl.invocation_errors, lvl.tokenizer_failures, lvl.empty_responses,
                     _triple(lvl.ttft_ms), _triple(lvl.tpot_ms), _triple(lvl.itl_ms), _triple(lvl.latency_ms),
                     num(lvl.input_tokens_per_s), num(lvl.output_tokens_per_s), num(lvl.request_throughput_per_s, 2),
                     num(per.input_tokens_per_s.mean if per.input_tokens_per_s else None),
                     num(per.output_tokens_per_s.mean if per.output_tokens_per_s else None),
                     num(per.input_tokens.mean if per.input_tokens else None),
                     num(per.output_tokens.mean if per.output_tokens else None),
                     money(lvl.price.per_million_input_tokens), money(lvl.price.per_million_output_tokens),
                     money(lvl.price.blended_per_million_tokens), num(lvl.goodput.requests_per_s, 2),
                     f"{spec.acceptance_rate:.2f} (mean length {spec.mean_accepted_length:.2f})" if spec else "",
                     cached(lvl.prefix_cache), bound(lvl.decode_bound)))
    aborted = f'<p class="warn">Aborted: {escape(target.aborted)}</p>' if target.aborted else ""
    known = next((lvl.decode_bound for lvl in target.levels if lvl.decode_bound), None)
    note = (f"<p>Decode vs bound: tokens/s decoded (concurrency / TPOT p50) against what this machine allows, "
            f"{known.weights_read_per_token_bytes / 1e6:.0f} MB of weights read per step (and the KV cache at the "
            f"level's mean context) at {known.read_gb_s:.1f} GB/s measured read bandwidth, or its matmul rate "
            f"where that binds first; a speculating level's step yields the tokens its steps kept, and a draft "
            f"model's passes add their reads.</p>") if known else ""
    return _table(head, rows) + note + aborted


def _triple(s: Stats | None) -> str:
    return "" if not s else f"{s.p50:.1f} / {s.p90:.1f} / {s.p99:.1f}"


def _quality_html(target: TargetResult) -> str:
    parts = []
    if target.quality and target.quality.perplexity:
        ppl = target.quality.perplexity
        parts.append(f"perplexity {ppl.perplexity:.3f} over {ppl.tokens} held-out tokens")
    acc = target.levels[0].accuracy if target.levels else None
    if acc:
        parts.append(f"task accuracy {acc.correct}/{acc.answered} ({acc.rate:.0%})")
    return f"<p>Quality: {escape('; '.join(parts))}</p>" if parts else ""


def comparison_table(results_comparison: Comparison) -> str:
    head, rows = comparison.table(results_comparison)
    return (f"<h2>Against {escape(results_comparison.reference)}</h2>" + _table(tuple(head), [tuple(r) for r in rows])
            + f'<p class="meta">{escape(comparison.NOTE)}</p>')

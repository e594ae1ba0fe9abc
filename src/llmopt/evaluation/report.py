"""Presentation: the comparison between targets, the JSON file, the HTML report and the terminal table."""

from __future__ import annotations

import json
import time
from html import escape
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from llmopt.evaluation import charts, quality

RESULTS_FILE, REPORT_FILE = "results.json", "report.html"


def _p50(level: dict, key: str) -> float | None:
    return (level.get(key) or {}).get("p50")


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference not in (None, 0) else None


def compare(targets: list[dict[str, Any]]) -> dict[str, Any]:
    """Each target against the first: throughput, latency, price and quality ratios per level."""
    reference = targets[0]
    by_level = {lvl["concurrency"]: lvl for lvl in reference["levels"]}
    ref_quality = reference.get("quality") or {}
    rows = []
    for target in targets[1:]:
        levels = []
        for level in target["levels"]:
            ref = by_level.get(level["concurrency"])
            if ref is None:
                continue
            levels.append({
                "concurrency": level["concurrency"],
                "output_tokens_per_s": _ratio(level["output_tokens_per_s"], ref["output_tokens_per_s"]),
                "ttft_p50": _ratio(_p50(level, "ttft_ms"), _p50(ref, "ttft_ms")),
                "itl_p50": _ratio(_p50(level, "itl_ms"), _p50(ref, "itl_ms")),
                "latency_p50": _ratio(_p50(level, "latency_ms"), _p50(ref, "latency_ms")),
                "blended_price": _ratio(level["price"]["blended_per_million_tokens"], ref["price"]["blended_per_million_tokens"]),
            })
        row: dict[str, Any] = {"label": target["label"], "reference": reference["label"], "levels": levels}
        mine = target.get("quality") or {}
        if "perplexity" in mine and "perplexity" in ref_quality:
            row["perplexity_ratio"] = mine["perplexity"]["perplexity"] / ref_quality["perplexity"]["perplexity"]
        if "greedy_tokens" in mine and "greedy_tokens" in ref_quality:
            row["greedy_agreement"] = quality.agreement(ref_quality["greedy_tokens"], mine["greedy_tokens"])
        ref_acc, acc = (reference["levels"] or [{}])[0].get("accuracy"), (target["levels"] or [{}])[0].get("accuracy")
        if ref_acc and acc:
            row["accuracy_change"] = acc["rate"] - ref_acc["rate"]
        rows.append(row)
    return {"reference": reference["label"], "targets": rows}


def write(results: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    tmp = output / (RESULTS_FILE + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.rename(output / RESULTS_FILE)
    (output / REPORT_FILE).write_text(html(results))


def table(results: dict[str, Any], console: Console) -> None:
    for target in results["targets"]:
        t = Table(title=f"{target['label']} — {results['workload']['name']}")
        for column in ("conc", "TTFT p50 ms", "ITL p50 ms", "latency p50 ms", "in tok/s", "out tok/s", "req/s",
                       "invocations", "errors", "empty", "$/1M in", "$/1M out", "$/1M blended", "accept"):
            t.add_column(column, justify="right")
        for lvl in target["levels"]:
            spec = lvl.get("speculative")
            t.add_row(str(lvl["concurrency"]), _num(_p50(lvl, "ttft_ms")), _num(_p50(lvl, "itl_ms")),
                      _num(_p50(lvl, "latency_ms")), _num(lvl["input_tokens_per_s"]), _num(lvl["output_tokens_per_s"]),
                      _num(lvl["request_throughput_per_s"], 2), str(lvl["invocations"]), str(lvl["invocation_errors"]),
                      str(lvl["empty_responses"]), _money(lvl["price"]["per_million_input_tokens"]),
                      _money(lvl["price"]["per_million_output_tokens"]), _money(lvl["price"]["blended_per_million_tokens"]),
                      f"{spec['acceptance_rate']:.2f}" if spec else "")
        console.print(t)
        q = target.get("quality") or {}
        if "perplexity" in q:
            console.print(f"perplexity {q['perplexity']['perplexity']:.3f} over {q['perplexity']['tokens']} held-out tokens")
        if target.get("aborted"):
            console.print(f"[red]aborted:[/] {target['aborted']}")
    if results.get("comparison"):
        c = Table(title=f"Ratios to {results['comparison']['reference']}")
        for column in ("target", "conc", "out tok/s", "TTFT p50", "ITL p50", "latency p50", "price", "perplexity", "greedy agreement"):
            c.add_column(column, justify="right")
        for row in results["comparison"]["targets"]:
            for lvl in row["levels"]:
                c.add_row(row["label"], str(lvl["concurrency"]), _x(lvl["output_tokens_per_s"]), _x(lvl["ttft_p50"]),
                          _x(lvl["itl_p50"]), _x(lvl["latency_p50"]), _x(lvl["blended_price"]),
                          _x(row.get("perplexity_ratio")), _pct((row.get("greedy_agreement") or {}).get("token_agreement")))
        console.print(c)


def _num(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _money(value: float | None) -> str:
    return "" if value is None else f"${value:,.3f}"


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def html(results: dict[str, Any]) -> str:
    targets = results["targets"]

    def series(key: str, pick) -> dict[str, list[tuple[float, float]]]:
        return {t["label"]: [(lvl["concurrency"], pick(lvl)) for lvl in t["levels"]] for t in targets}

    latency_charts = [
        charts.line_chart("Time to first token (p50)", "concurrency", "ms", series("ttft", lambda l: _p50(l, "ttft_ms")), True),
        charts.line_chart("Inter-token latency (p50)", "concurrency", "ms", series("itl", lambda l: _p50(l, "itl_ms")), True),
        charts.line_chart("Client latency (p50)", "concurrency", "ms", series("lat", lambda l: _p50(l, "latency_ms")), True),
        charts.line_chart("Output throughput", "concurrency", "tokens/s", series("out", lambda l: l["output_tokens_per_s"]), True),
        charts.line_chart("Blended price (3:1 in:out)", "concurrency", "$ per 1M tokens",
                          series("price", lambda l: l["price"]["blended_per_million_tokens"]), True),
    ]
    distributions = []
    for key, title in (("ttft_ms", "TTFT distribution"), ("itl_ms", "ITL distribution")):
        lines = {f"{t['label']} @{lvl['concurrency']}": lvl["samples"][key] for t in targets for lvl in t["levels"]}
        distributions.append(charts.cdf_chart(title, "ms", lines))
    sections = [f"<h2>{escape(t['label'])}</h2>{_level_table(t)}{_quality_html(t)}" for t in targets]
    comparison = _comparison_html(results["comparison"]) if results.get("comparison") else ""
    price = results["price"]
    workload = results["workload"] or {}
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(results["created_at"]))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmopt evaluation</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, th:first-child {{ text-align: left; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 12px; }} .meta {{ color: #555; font-size: 13px; }}
.warn {{ color: #b00; }} .wide {{ overflow-x: auto; }}
</style></head><body>
<h1>llmopt evaluation</h1>
<p class="meta">{escape(created)} · workload <b>{escape(str(workload.get('name')))}</b> ({workload.get('requests')} requests, temperature {workload.get('temperature')}, seed {workload.get('seed')})
 · price: {escape(price['name'])} ${price['price_per_hour']}/h, discount {price['discount']:.0%} (as of {escape(price['as_of'])})
 · schema {escape(results['schema'])}</p>
{comparison}
<h2>Latency, throughput and price by concurrency</h2><div class="charts">{''.join(latency_charts)}</div>
<h2>Distributions</h2><div class="charts">{''.join(distributions)}</div>
{''.join(sections)}
</body></html>"""


def _level_table(target: dict) -> str:
    head = ("concurrency", "invocations", "errors", "tokenizer failures", "empty", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
            "latency p50/p90/p99 ms", "in tok/s", "out tok/s", "in tok/s/req", "out tok/s/req", "in tokens/req",
            "out tokens/req", "$/1M in", "$/1M out", "$/1M blended", "goodput req/s", "acceptance")
    rows = []
    for lvl in target["levels"]:
        spec = lvl.get("speculative")
        per = lvl["per_request"]
        cells = (lvl["concurrency"], lvl["invocations"], lvl["invocation_errors"], lvl["tokenizer_failures"], lvl["empty_responses"],
                 _triple(lvl["ttft_ms"]), _triple(lvl["itl_ms"]), _triple(lvl["latency_ms"]), _num(lvl["input_tokens_per_s"]),
                 _num(lvl["output_tokens_per_s"]), _num((per["input_tokens_per_s"] or {}).get("mean")),
                 _num((per["output_tokens_per_s"] or {}).get("mean")), _num((per["input_tokens"] or {}).get("mean")),
                 _num((per["output_tokens"] or {}).get("mean")), _money(lvl["price"]["per_million_input_tokens"]),
                 _money(lvl["price"]["per_million_output_tokens"]), _money(lvl["price"]["blended_per_million_tokens"]),
                 _num(lvl["goodput"]["requests_per_s"], 2),
                 f"{spec['acceptance_rate']:.2f} (mean length {spec['mean_accepted_length']:.2f})" if spec else "")
        rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    aborted = f'<p class="warn">Aborted: {escape(target["aborted"])}</p>' if target.get("aborted") else ""
    return ('<div class="wide"><table><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows)
            + "</table></div>" + aborted)


def _triple(s: dict | None) -> str:
    return "" if not s else f"{s['p50']:.1f} / {s['p90']:.1f} / {s['p99']:.1f}"


def _quality_html(target: dict) -> str:
    q = target.get("quality") or {}
    parts = []
    if "perplexity" in q:
        parts.append(f"perplexity {q['perplexity']['perplexity']:.3f} over {q['perplexity']['tokens']} held-out tokens")
    acc = (target["levels"] or [{}])[0].get("accuracy")
    if acc:
        parts.append(f"task accuracy {acc['correct']}/{acc['answered']} ({acc['rate']:.0%})")
    return f"<p>Quality: {escape('; '.join(parts))}</p>" if parts else ""


def _comparison_html(comparison: dict) -> str:
    rows = []
    for row in comparison["targets"]:
        agreement = (row.get("greedy_agreement") or {}).get("token_agreement")
        for lvl in row["levels"]:
            cells = (row["label"], lvl["concurrency"], _x(lvl["output_tokens_per_s"]), _x(lvl["ttft_p50"]), _x(lvl["itl_p50"]),
                     _x(lvl["latency_p50"]), _x(lvl["blended_price"]), _x(row.get("perplexity_ratio")), _pct(agreement))
            rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    head = ("target", "concurrency", "output tok/s", "TTFT p50", "ITL p50", "latency p50", "blended price", "perplexity", "greedy agreement")
    return (f"<h2>Ratios to {escape(comparison['reference'])}</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in head)
            + "</tr>" + "".join(rows) + "</table>")

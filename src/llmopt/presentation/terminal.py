"""Terminal tables (rich) for the CLI: evaluation results and record listings."""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table

from llmopt.evaluation.results import Comparison, EvaluationResults, Stats
from llmopt.presentation import comparison
from llmopt.presentation.format import bound, cached, money, num


def _p50(stats: Stats | None) -> float | None:
    return stats.p50 if stats else None


def listing(console: Console, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], keys: int = 1) -> None:
    """A record per row; the first column names it, and stays whole on one line (what a user copies
    into the next command). Columns that do not fit the terminal go on in further tables, each led
    by the first `keys` columns again (what tells the rows apart), rather than every cell folding to
    a character or two (a 13-column ranked table at 80 columns did)."""
    cells = [["" if v is None else str(v) for v in row] for row in rows]
    for i, group in enumerate(column_groups(console.width, columns, cells, keys)):
        table = Table(title=title if i == 0 else None)
        for j in (*range(keys), *group):
            table.add_column(columns[j], overflow="fold", no_wrap=j == 0)
        for row in cells:
            table.add_row(*(row[j] for j in (*range(keys), *group)))
        console.print(table)


def column_groups(width: int, columns: Sequence[str], cells: Sequence[Sequence[str]], keys: int = 1) -> list[list[int]]:
    """The columns after the first `keys`, in order, in groups that fit `width` beside those."""
    def needs(j: int) -> int:  # the widest cell or header, with the cell's padding and border
        return 3 + max([len(columns[j])] + [len(line) for row in cells for line in row[j].splitlines()])

    lead = 1 + sum(needs(j) for j in range(keys))
    groups: list[list[int]] = [[]]
    used = lead
    for j in range(keys, len(columns)):
        if groups[-1] and used + needs(j) > width:
            groups.append([])
            used = lead
        groups[-1].append(j)
        used += needs(j)
    return groups


def evaluation(results: EvaluationResults, console: Console) -> None:
    workload = results.workload.name if results.workload else ""
    for target in results.targets:
        t = Table(title=f"{target.label} — {workload}")
        for column in ("conc", "TTFT p50 ms", "TPOT p50 ms", "latency p50 ms", "in tok/s", "out tok/s", "req/s",
                       "invocations", "errors", "empty", "$/1M in", "$/1M out", "$/1M blended", "accept", "prefix cached",
                       "decode vs bound tok/s"):
            t.add_column(column, justify="right")
        for lvl in target.levels:
            spec = lvl.speculative
            t.add_row(str(lvl.concurrency), num(_p50(lvl.ttft_ms)), num(_p50(lvl.tpot_ms)), num(_p50(lvl.latency_ms)),
                      num(lvl.input_tokens_per_s), num(lvl.output_tokens_per_s), num(lvl.request_throughput_per_s, 2),
                      str(lvl.invocations), str(lvl.invocation_errors), str(lvl.empty_responses),
                      money(lvl.price.per_million_input_tokens), money(lvl.price.per_million_output_tokens),
                      money(lvl.price.blended_per_million_tokens), f"{spec.acceptance_rate:.2f}" if spec else "",
                      cached(lvl.prefix_cache), bound(lvl.decode_bound))
        console.print(t)
        if target.quality and target.quality.perplexity:
            ppl = target.quality.perplexity
            console.print(f"perplexity {ppl.perplexity:.3f} over {ppl.tokens} held-out tokens")
        if target.aborted:
            console.print(f"[red]aborted:[/] {target.aborted}")
    if results.comparison:
        comparison_listing(results.comparison, console)


def comparison_listing(compared: Comparison, console: Console) -> None:
    """A row is a target at a level, so both lead every table its columns go on in: led by the
    target alone, a narrow terminal printed the quality columns as the same row twice."""
    head, rows = comparison.table(compared)
    listing(console, f"Against {compared.reference}", head, rows, keys=2)
    console.print(comparison.NOTE)

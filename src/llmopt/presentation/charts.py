"""Inline SVG charts, so the HTML report reads offline with no scripts or downloads."""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
WIDTH, HEIGHT = 460, 280
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 30, 44


def _nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start = math.floor(low / step) * step
    return [start + i * step for i in range(int(math.ceil((high - start) / step)) + 1)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value / 1000:.3g}k"
    return f"{value:.3g}"


def line_chart(title: str, xlabel: str, ylabel: str, series: dict[str, list[tuple[float, float]]],
               categorical_x: bool = False, step: bool = False, y_top: float | None = None) -> str:
    """One line per series. With categorical_x the x values are spaced evenly (concurrency levels)."""
    points = [p for values in series.values() for p in values if p[1] is not None]
    if not points:
        return f'<svg width="{WIDTH}" height="{HEIGHT}" role="img"><text x="20" y="40">{escape(title)}: no data</text></svg>'
    xs = sorted({p[0] for p in points})
    y_ticks = _nice_ticks(0.0, y_top if y_top is not None else max(p[1] for p in points) * 1.05)
    y_max = y_ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    if categorical_x:
        position = {x: LEFT + (i + 0.5) * plot_w / len(xs) for i, x in enumerate(xs)}
        x_of = position.__getitem__
        x_ticks = [(position[x], _fmt(x)) for x in xs]
    else:
        x_min, x_max = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        x_of = lambda x: LEFT + (x - x_min) / (x_max - x_min) * plot_w  # noqa: E731
        x_ticks = [(x_of(t), _fmt(t)) for t in _nice_ticks(x_min, x_max) if x_min <= t <= x_max]
    y_of = lambda y: TOP + plot_h - (y / y_max) * plot_h  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-weight="bold" font-size="13">{escape(title)}</text>']
    for tick in y_ticks:
        y = y_of(tick)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{_fmt(tick)}</text>')
    for x, label in x_ticks:
        parts.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle" font-size="11">{label}</text>')
    parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" stroke="#333"/>')
    parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#333"/>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle" font-size="12">{escape(xlabel)}</text>')
    parts.append(f'<text x="14" y="{TOP + plot_h / 2}" text-anchor="middle" font-size="12" transform="rotate(-90 14 {TOP + plot_h / 2})">{escape(ylabel)}</text>')
    for i, (label, values) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        coords = [(x_of(x), y_of(y)) for x, y in values if y is not None]
        if step and coords:
            stepped = [coords[0]]
            for (x0, y0), (x1, y1) in zip(coords, coords[1:]):
                stepped += [(x1, y0), (x1, y1)]
            coords = stepped
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        if not step:
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in coords]
        parts.append(f'<rect x="{LEFT + 8}" y="{TOP + 6 + i * 15}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{LEFT + 22}" y="{TOP + 15 + i * 15}" font-size="11">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def cdf_chart(title: str, xlabel: str, series: dict[str, list[float]]) -> str:
    """Empirical distribution functions: the share of samples at or below each value."""
    lines = {}
    for label, values in series.items():
        ordered = sorted(values)
        n = len(ordered)
        if n:
            lines[label] = [(v, (i + 1) / n * 100) for i, v in enumerate(ordered)]
    return line_chart(title, xlabel, "% of samples ≤ x", lines, step=True, y_top=100)


def scatter_chart(title: str, xlabel: str, ylabel: str, points: dict[str, tuple[float, float]], front: list[str]) -> str:
    """Labelled points, with the Pareto front joined by a line (front given in drawing order)."""
    if not points:
        return f'<svg width="{WIDTH}" height="{HEIGHT}" role="img"><text x="20" y="40">{escape(title)}: no data</text></svg>'
    xs, ys = [p[0] for p in points.values()], [p[1] for p in points.values()]
    x_ticks, y_ticks = _nice_ticks(0.0, max(xs) * 1.08), _nice_ticks(0.0, max(ys) * 1.08)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    x_of = lambda x: LEFT + x / x_ticks[-1] * plot_w  # noqa: E731
    y_of = lambda y: TOP + plot_h - y / y_ticks[-1] * plot_h  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-weight="bold" font-size="13">{escape(title)}</text>']
    for tick in y_ticks:
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y_of(tick):.1f}" y2="{y_of(tick):.1f}" stroke="#e5e5e5"/>'
                     f'<text x="{LEFT - 6}" y="{y_of(tick) + 4:.1f}" text-anchor="end" font-size="11">{_fmt(tick)}</text>')
    for tick in x_ticks:
        parts.append(f'<text x="{x_of(tick):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle" font-size="11">{_fmt(tick)}</text>')
    parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" stroke="#333"/>'
                 f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#333"/>'
                 f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle" font-size="12">{escape(xlabel)}</text>'
                 f'<text x="14" y="{TOP + plot_h / 2}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {TOP + plot_h / 2})">{escape(ylabel)}</text>')
    line = [points[label] for label in front if label in points]
    if len(line) > 1:
        path = " ".join(f"{x_of(x):.1f},{y_of(y):.1f}" for x, y in line)
        parts.append(f'<polyline class="front" fill="none" stroke="{PALETTE[1]}" stroke-width="1.5" stroke-dasharray="4 3" points="{path}"/>')
    for label, (x, y) in points.items():
        on_front = label in front
        parts.append(f'<circle class="{"front" if on_front else "point"}" cx="{x_of(x):.1f}" cy="{y_of(y):.1f}" r="{4 if on_front else 3}" '
                     f'fill="{PALETTE[1] if on_front else PALETTE[0]}"><title>{escape(label)}: {_fmt(x)}, {_fmt(y)}</title></circle>'
                     f'<text x="{x_of(x) + 5:.1f}" y="{y_of(y) - 5:.1f}" font-size="9" fill="#555">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)

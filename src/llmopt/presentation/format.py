"""How numbers read, the same in the terminal, the report and the studio."""

from __future__ import annotations

import time


def num(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def money(value: float | None) -> str:
    return "" if value is None else f"${value:,.3f}"


def times(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def pct(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else ""


def megabytes(size: int | None) -> str:
    return "" if size is None else f"{size / 1e6:.0f} MB"

"""How numbers read, the same in the terminal, the report and the studio."""

from __future__ import annotations

import time

from llmopt.engine.metrics import PrefixCacheStats
from llmopt.evaluation.results import DecodeBound, Ratio


def num(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def money(value: float | None) -> str:
    return "" if value is None else f"${value:,.3f}"


def times(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def pct(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}%}"


def ratio(r: Ratio | None, better: str = "faster", worse: str = "slower") -> str:
    """'1.58x faster [1.41-1.77]', or 'no measurable difference [0.97-1.04]' when the interval spans 1."""
    if r is None:
        return ""
    low, high = r.gain_interval
    if not r.measurable:
        return f"no measurable difference [{low:.2f}-{high:.2f}]"
    gain = r.gain
    return f"{gain:.2f}x {better} [{low:.2f}-{high:.2f}]" if gain >= 1 else f"{1 / gain:.2f}x {worse} [{1 / high:.2f}-{1 / low:.2f}]"


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else ""


def megabytes(size: int | None) -> str:
    return "" if size is None else f"{size / 1e6:.0f} MB"


def bound(found: DecodeBound | None) -> str:
    """'54% of 73 (memory)': decode speed as a share of the machine's bound, in tokens/s; a
    speculating level's says how many tokens a step kept ('..., 2.1 tokens a step')."""
    if found is None:
        return ""
    step = f", {found.accepted_length:.1f} tokens a step" if found.accepted_length is not None else ""
    return f"{found.fraction:.0%} of {found.bound_tok_s:.0f} ({found.limited_by}{step})"


def cached(found: PrefixCacheStats | None) -> str:
    """'38% of 4,862': the share of a level's prompt tokens its engine found in the prefix cache."""
    return "" if found is None else f"{found.hit_rate:.0%} of {found.queried_tokens:,.0f}"

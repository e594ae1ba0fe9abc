"""The engine's own counters from its Prometheus `/metrics`: speculative-decoding acceptance."""

from __future__ import annotations

import asyncio

import aiohttp

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def parse(text: str) -> dict[str, float]:
    """Sum every sample of the counters we use, across their label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        name = name.removesuffix("_total")
        if name in SPEC_COUNTERS:
            try:
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return totals


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return parse(await response.text()) if response.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def speculative(counters: dict[str, float]) -> dict[str, float] | None:
    """Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    draft_tokens = counters.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    if not drafts or not draft_tokens:
        return None
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens,
        "mean_accepted_length": 1 + accepted / drafts,
    }

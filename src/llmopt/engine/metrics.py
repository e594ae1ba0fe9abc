"""vLLM's Prometheus counters (`/metrics`): speculative decoding's (and the proof that it is running)
and the prefix cache's.

A deployment configured for speculation that proposes no drafts is an error, not a warning: the
SageMaker toolkit's users found speculation silently off, and llmopt checks it every time.
"""

from __future__ import annotations

import httpx
from pydantic import BaseModel

from llmopt.errors import LlmoptError

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
# Prompt tokens looked up in the prefix cache as each request is first scheduled, and those found
PREFIX_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
COUNTERS = SPEC_COUNTERS + PREFIX_COUNTERS
# A raw-text prompt whose continuation repeats the prompt, so that even n-gram lookup (and any
# draft model) proposes drafts that the target accepts. Sent as a completion, not a chat, so a
# chat model's habit of answering in prose cannot get in the way.
PROBE_PROMPT = "red apple, green pear, yellow lemon, purple plum, orange peach; " * 3 + "red apple,"


def parse(text: str) -> dict[str, float]:
    """Sum every sample of the counters we use, across their label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in COUNTERS:
            try:
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return totals


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the counters counted between two scrapes; nothing where the first found none (a failed
    scrape): the second's totals since the server started would read as the run's."""
    return {k: after[k] - before.get(k, 0.0) for k in after} if before else {}


class SpeculationStats(BaseModel):
    """Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    acceptance_rate: float
    mean_accepted_length: float


def speculative(counters: dict[str, float]) -> SpeculationStats | None:
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    draft_tokens = counters.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    if not drafts or not draft_tokens:
        return None
    return SpeculationStats(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                            acceptance_rate=accepted / draft_tokens, mean_accepted_length=1 + accepted / drafts)


class PrefixCacheStats(BaseModel):
    """The share of a run's prompt tokens the engine found in its prefix cache, and so did not
    prefill: what tells a TTFT measured on a cache that served more of one run's prompts."""

    queried_tokens: float
    hit_tokens: float
    hit_rate: float


def prefix_cache(counters: dict[str, float]) -> PrefixCacheStats | None:
    queried = counters.get("vllm:prefix_cache_queries", 0.0)
    if not queried:
        return None
    hits = counters.get("vllm:prefix_cache_hits", 0.0)
    return PrefixCacheStats(queried_tokens=queried, hit_tokens=hits, hit_rate=hits / queried)


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics", timeout=10, headers=headers)
    response.raise_for_status()
    return parse(response.text)


def verify_speculation(url: str, served_name: str, headers: dict[str, str] | None = None) -> SpeculationStats:
    """Send a probe request and require the engine to have proposed and accepted drafts for it."""
    before = scrape(url, headers)
    body = {"model": served_name, "prompt": PROBE_PROMPT, "max_tokens": 48, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=300, headers=headers).raise_for_status()
    stats = speculative(delta(before, scrape(url, headers)))
    if stats is None:
        raise LlmoptError(
            "speculative decoding is configured but the engine proposed no drafts for a probe request",
            "check the engine log; redeploy without speculation if this engine cannot run it",
        )
    if stats.accepted_tokens <= 0:
        raise LlmoptError(
            f"speculative decoding proposed {stats.draft_tokens:.0f} draft tokens and accepted none",
            "the draft does not match the target; use the recommended draft or ngram",
        )
    return stats

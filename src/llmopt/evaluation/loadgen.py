"""Load generation: an asyncio streaming client that runs a workload at one concurrency level.

The client records raw timestamps only (request start, each streamed chunk, end); all arithmetic
happens afterwards in metrics.py, so the hot loop does as little as possible and the client is
never the bottleneck (benchmarks/loadgen_client.py drives a stub stream at well over 20,000
tokens/s on two cores).

Every request is prefilled as new. vLLM keeps prompts it has seen, and a level replays its prompts
(its warm-up's too, each pass when a level outlasts one, and a workload's prompts within one pass
when the level sends more than the workload has), as later levels and legs do; without a fresh
`cache_salt` for the warm-up and for each of those passes, a leg replaying them measured cached
prefill (time to first token 50 ms instead of 300 ms on SmolLM2) and compared unlike work. Prompts
of one pass still share what they have in common (a system prompt), as they would live. A server
that takes no salt (not vLLM, or a vLLM before 0.11) serves repeated prompts from its cache.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field

import aiohttp
from packaging.version import InvalidVersion, Version

from llmopt.engine import metrics as engine_metrics
from llmopt.evaluation.workload import Request, Workload

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class RequestRecord:
    index: int
    started: float
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    text: str = ""
    error: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.started if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.ended - self.started


@dataclass
class LevelRun:
    concurrency: int
    records: list[RequestRecord]
    plan: list[Request]  # record.index points into it
    started: float
    ended: float
    aborted: str | None = None
    engine_counters: dict[str, float] = field(default_factory=dict)  # deltas of the engine's /metrics

    @property
    def duration(self) -> float:
        return max(self.ended - self.started, 1e-9)


@dataclass(frozen=True)
class RunSettings:
    requests_per_level: int | None = 32
    duration_s: float | None = None
    warmup_requests: int | None = None  # default: one per concurrent user
    timeout_s: float = DEFAULT_TIMEOUT_S
    min_duration_s: float = 0.0  # with a request count: go on, in whole passes over its prompts, until this long has passed too
    first_request: int | None = None  # the workload's first measured request; default: the one after the warm-up's


def request_body(model: str, request: Request, workload: Workload, cache_salt: str | None = None) -> dict:
    body: dict = {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "temperature": workload.temperature,
        "seed": workload.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload.ignore_eos:
        body.update(ignore_eos=True, min_tokens=request.max_tokens)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


async def _send(session: aiohttp.ClientSession, url: str, body: dict, index: int, timeout_s: float) -> RequestRecord:
    """One streamed chat completion, timed chunk by chunk."""
    record = RequestRecord(index=index, started=time.perf_counter())
    parts: list[str] = []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for raw in response.content:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(raw[6:])
                usage = chunk.get("usage")
                if usage:
                    record.usage_prompt_tokens = usage.get("prompt_tokens")
                    record.usage_completion_tokens = usage.get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        record.chunk_times.append(now)
                        parts.append(content)
    except asyncio.TimeoutError:
        record.error = f"timeout after {timeout_s:.0f} s"
    except aiohttp.ClientConnectionError as exc:
        record.error = f"connection error: {type(exc).__name__}: {exc}"
    except aiohttp.ClientError as exc:
        record.error = f"client error: {type(exc).__name__}: {exc}"
    finally:
        record.ended = time.perf_counter()
        record.text = "".join(parts)
    return record


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return engine_metrics.parse(await response.text()) if response.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


async def _reachable(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def _cache_salt(session: aiohttp.ClientSession, url: str) -> str | None:
    """A fresh prefix-cache salt for a vLLM server that takes one (it answers /version with 0.11 or
    later; 0.9-0.10 refuse the field on their V0 engine); None for other servers, which may refuse
    a field they do not know."""
    try:
        async with session.get(f"{url}/version", timeout=aiohttp.ClientTimeout(total=5)) as response:
            found = await response.json(content_type=None) if response.status == 200 else None
        release = Version(str(found["version"])).release if isinstance(found, dict) else ()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, InvalidVersion):
        return None
    return f"llmopt-{secrets.token_hex(8)}" if release >= (0, 11) else None


async def run_level(url: str, model: str, workload: Workload, concurrency: int, settings: RunSettings,
                    headers: dict[str, str], on_done=None) -> LevelRun:
    """Warm up, then keep `concurrency` requests in flight until the level's count or time is used."""
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        salt = await _cache_salt(session, url)
        warmup = settings.warmup_requests if settings.warmup_requests is not None else concurrency
        if warmup:
            await asyncio.gather(*(_send(session, url, request_body(model, r, workload, salt and f"{salt}-warmup"), -1,
                                         settings.timeout_s)
                                   for r in workload.take(warmup)))
        before = await _scrape(session, url)
        count = settings.requests_per_level if settings.duration_s is None else None
        # measured requests start after the warm-up's, so warm-up does not pre-fill their prefix cache
        first = settings.first_request if settings.first_request is not None else warmup
        plan = workload.take(count if count is not None else max(len(workload.requests), concurrency), start=first)
        next_index = 0
        records: list[RequestRecord] = []
        aborted: str | None = None
        started = time.perf_counter()
        deadline = started + settings.duration_s if settings.duration_s else None

        floor = started + settings.min_duration_s

        def _sending(index: int) -> str:
            """Which pass over the plan, and within it which pass over the workload's prompts: a
            plan longer than the workload sends a prompt again within one pass, as new."""
            return f"{index // len(plan)}.{(first + index % len(plan)) // len(workload.requests)}"

        async def user() -> None:
            nonlocal next_index, aborted
            while aborted is None:
                if deadline is not None:
                    if time.perf_counter() >= deadline:
                        return
                elif next_index >= len(plan) and next_index % len(plan) == 0 and time.perf_counter() >= floor:
                    return  # at the end of a pass: every level's work is whole passes over the same prompts
                index = next_index
                next_index += 1
                body = request_body(model, plan[index % len(plan)], workload, salt and f"{salt}-{_sending(index)}")
                record = await _send(session, url, body, index, settings.timeout_s)
                records.append(record)
                if on_done is not None:
                    on_done(record)
                if record.error and record.error.startswith("connection") and not await _reachable(session, url):
                    aborted = f"endpoint {url} stopped answering during the run ({record.error})"

        await asyncio.gather(*(user() for _ in range(concurrency)))
        ended = max((r.ended for r in records), default=time.perf_counter())
        after = await _scrape(session, url) if aborted is None else {}
    records.sort(key=lambda r: r.index)
    return LevelRun(concurrency, records, plan, started, ended, aborted, engine_metrics.delta(before, after))

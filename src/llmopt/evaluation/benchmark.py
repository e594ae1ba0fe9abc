"""An evaluation: one workload against one or more targets, each swept over concurrency levels,
with quality measured on the same targets, written as JSON and HTML as it goes.

A target is an endpoint llmopt runs, any OpenAI-compatible URL, or a model/artifact that is
deployed for the evaluation and stopped after it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import httpx

from llmopt import corpus, endpoints, sdk
from llmopt.errors import LlmoptError
from llmopt.evaluation import loadgen, metrics, pricing, quality, report, workload as workloads
from llmopt.evaluation.tokens import TokenCounter

SCHEMA = "llmopt.evaluation/v1"
Events = Callable[..., None]


@dataclass
class Target:
    label: str
    kind: str  # endpoint | url | deployed
    url: str
    served_name: str
    tokenizer_path: str | None
    engine: dict[str, Any] = field(default_factory=dict)
    deployed: endpoints.Endpoint | None = None


@dataclass(frozen=True)
class EvaluationSpec:
    dataset: str = "builtin-qa"
    concurrency: tuple[int, ...] = (1, 4)
    requests: int | None = 16
    duration_s: float | None = None
    warmup_requests: int | None = None
    timeout_s: float = loadgen.DEFAULT_TIMEOUT_S
    seed: int = 0
    quality: bool = True
    goodput: metrics.GoodputTargets = metrics.GoodputTargets()
    tokenizer: str | None = None

    def validate(self) -> None:
        if not self.concurrency or any(c <= 0 for c in self.concurrency):
            raise LlmoptError(f"bad concurrency levels {self.concurrency}", "give positive integers, e.g. --concurrency 1,2,4")
        if self.requests is not None and self.requests <= 0:
            raise LlmoptError("--requests must be positive", "e.g. --requests 16")
        if self.duration_s is not None and self.duration_s <= 0:
            raise LlmoptError("--duration must be positive", "e.g. --duration 30")


def resolve_target(spec: str, kind: str, tokenizer: str | None) -> Target:
    if kind == "endpoint":
        endpoint = endpoints.get(spec)
        if endpoint.status != endpoints.READY:
            raise LlmoptError(f"endpoint '{spec}' is {endpoint.status}", "deploy it again with `llmopt deploy`")
        return Target(spec, "endpoint", endpoint.url, endpoint.served_name, tokenizer or endpoint.model_path,
                      {"args": json.loads(endpoint.engine_args), "env": json.loads(endpoint.engine_env)})
    if kind == "url":
        url = spec.rstrip("/")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise LlmoptError(f"cannot reach an OpenAI-compatible server at {url} ({type(exc).__name__})",
                              "check the URL and that the server is running") from None
        root = models[0].get("root")
        path = tokenizer or (root if root and Path(root).exists() else None)
        return Target(url, "url", url, models[0]["id"], path)
    raise ValueError(kind)


def deploy_target(spec: str, events: Events) -> Target:
    events("deploying", target=spec)
    endpoint = sdk.deploy(spec)
    events("deployed", target=spec, seconds=endpoint.seconds_to_ready)
    label = Path(spec).name if Path(spec).exists() else spec
    return Target(label, "deployed", endpoint.url, endpoint.served_name, endpoint.model_path,
                  {"args": json.loads(endpoint.engine_args), "env": json.loads(endpoint.engine_env),
                   "seconds_to_ready": endpoint.seconds_to_ready}, deployed=endpoint)


def run(targets: list[tuple[str, str]], spec: EvaluationSpec, price: pricing.HardwareProfile,
        output: Path | None = None, events: Events = lambda *a, **k: None) -> dict[str, Any]:
    """Evaluate each (spec, kind) target in turn; kind is endpoint, url or model (deployed here)."""
    spec.validate()
    results: dict[str, Any] = {
        "schema": SCHEMA, "created_at": time.time(), "price": price.to_dict(),
        "settings": {"concurrency": list(spec.concurrency), "requests_per_level": spec.requests,
                     "duration_s": spec.duration_s, "timeout_s": spec.timeout_s, "seed": spec.seed,
                     "goodput_targets": {"ttft_ms": spec.goodput.ttft_ms, "itl_ms": spec.goodput.itl_ms}},
        "workload": None, "targets": [], "comparison": None,
    }
    work: workloads.Workload | None = None
    for target_spec, kind in targets:
        target = deploy_target(target_spec, events) if kind == "model" else resolve_target(target_spec, kind, spec.tokenizer)
        try:
            counter = TokenCounter.from_path(target.tokenizer_path) if target.tokenizer_path else None
            if work is None:
                work = _workload(spec, counter)
                results["workload"] = work.describe()
            entry = _evaluate_target(target, work, counter, spec, price, events)
        finally:
            if target.deployed is not None:
                target.deployed.stop()
        results["targets"].append(entry)
        if len(results["targets"]) > 1:
            results["comparison"] = report.compare(results["targets"])
        if output is not None:
            report.write(results, output)
        if entry["aborted"]:
            break
    return results


def levels(url: str, served_name: str, tokenizer_path: str, spec: EvaluationSpec) -> list[dict[str, Any]]:
    """Load one server at each concurrency level, throughput and latency only: what a job needs to
    compare two engine settings side by side."""
    spec.validate()
    counter = TokenCounter.from_path(tokenizer_path)
    target = Target(url, "url", url, served_name, tokenizer_path)
    price = pricing.choose(None, None, None)
    entry = _evaluate_target(target, _workload(spec, counter), counter, replace(spec, quality=False), price, lambda *a, **k: None)
    if entry["aborted"]:
        raise LlmoptError(f"load test against {url} aborted: {entry['aborted']}", "see the engine log")
    return entry["levels"]


def _workload(spec: EvaluationSpec, counter: TokenCounter | None) -> workloads.Workload:
    count = max(spec.requests or 64, max(spec.concurrency)) + max(spec.concurrency)  # + warm-up
    return workloads.load(spec.dataset, seed=spec.seed, count=count, tokenizer=counter.tokenizer if counter else None)


def _evaluate_target(target: Target, work: workloads.Workload, counter: TokenCounter | None,
                     spec: EvaluationSpec, price: pricing.HardwareProfile, events: Events) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "label": target.label, "kind": target.kind, "url": target.url, "served_name": target.served_name,
        "tokenizer": target.tokenizer_path, "engine": target.engine, "levels": [], "quality": None, "aborted": None,
    }
    if counter is None:
        entry["warning"] = "no tokenizer: token counts come from the server's usage fields"
    settings = loadgen.RunSettings(spec.requests, spec.duration_s, spec.warmup_requests, spec.timeout_s)
    for level in spec.concurrency:
        events("level", target=target.label, concurrency=level, total=spec.requests)
        run_ = asyncio.run(loadgen.run_level(target.url, target.served_name, work, level, settings,
                                             on_done=lambda r: events("request", error=r.error)))
        computed = metrics.compute(run_, counter, price, spec.goodput)
        entry["levels"].append(computed)
        events("level_done", target=target.label, metrics=computed)
        if run_.aborted:
            entry["aborted"] = run_.aborted
            return entry
    if spec.quality:
        events("quality", target=target.label)
        entry["quality"] = measure_quality(target)
    return entry


def measure_quality(target: Target) -> dict[str, Any]:
    """Perplexity of held-out text and greedy outputs; either may be unavailable on a foreign server."""
    found: dict[str, Any] = {}
    try:
        found["perplexity"] = quality.perplexity(target.url, target.served_name, corpus.heldout_texts()).to_dict()
    except (httpx.HTTPError, KeyError, TypeError, IndexError) as exc:
        found["perplexity_error"] = f"{type(exc).__name__}: {exc}"
    try:
        found["greedy_tokens"] = quality.greedy_tokens(target.url, target.served_name)
    except (httpx.HTTPError, KeyError, TypeError) as exc:
        found["greedy_error"] = f"{type(exc).__name__}: {exc}"
    return found

"""An evaluation: one workload against one or more targets, each swept over concurrency levels,
with quality measured on the same targets, written as JSON and HTML as it goes.

A target is an endpoint llmopt runs, any OpenAI-compatible URL, or a model/artifact that is
deployed for the evaluation and stopped after it. For one whose weights llmopt can read (deployed
here, or an endpoint llmopt runs), each level says how close decoding came to the machine's bound.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from llmopt import corpus, endpoints, roofline, serving
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.evaluation import compare, levels, pricing, quality
from llmopt.evaluation import workload as workloads
from llmopt.evaluation.levels import Events, Plan
from llmopt.evaluation.results import DecodeBound, EvaluationResults, Level, Quality, Settings, TargetResult
from llmopt.evaluation.tokens import TokenCounter
from llmopt.presentation import report

TargetKind = Literal["endpoint", "url", "model"]


@dataclass
class Target:
    result: TargetResult  # filled in as the target is measured
    headers: dict[str, str]
    deployed: endpoints.Endpoint | None = None
    weights: Path | None = None  # the served model's folder, where llmopt knows it


def resolve_target(spec: str, kind: TargetKind, tokenizer: str | None, api_key: str | None = None) -> Target:
    """An endpoint llmopt runs (its own key is used), or any OpenAI-compatible URL (with `api_key`)."""
    if kind == "endpoint":
        endpoint = endpoints.get(spec)
        if endpoint.status != endpoints.READY:
            raise LlmoptError(f"endpoint '{spec}' is {endpoint.status}", "deploy it again with `llmopt deploy`")
        return Target(TargetResult(label=spec, kind="endpoint", url=endpoint.url, served_name=endpoint.served_name,
                                   tokenizer=tokenizer or endpoint.model_path, engine=endpoint.engine), endpoint.headers,
                      weights=Path(endpoint.model_path))
    url = spec.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10, headers=headers).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise LlmoptError(f"cannot reach an OpenAI-compatible server at {url} ({type(exc).__name__})",
                          "check the URL and that the server is running") from None
    root = models[0].get("root")
    path = tokenizer or (root if root and Path(root).exists() else None)
    return Target(TargetResult(label=url, kind="url", url=url, served_name=models[0]["id"], tokenizer=path), headers)


def deploy_target(spec: str, events: Events, checked: serving.ServingSpec | None = None) -> Target:
    """A model or artifact, served for the evaluation (as `checked` says, where it was resolved already)."""
    events("deploying", target=spec)
    endpoint = serving.deploy(checked or serving.for_target(spec), temporary=True)
    events("deployed", target=spec, seconds=endpoint.seconds_to_ready)
    label = Path(spec).name if Path(spec).exists() else spec
    return Target(TargetResult(label=label, kind="deployed", url=endpoint.url, served_name=endpoint.served_name,
                               tokenizer=endpoint.model_path, engine=endpoint.engine,
                               seconds_to_ready=endpoint.seconds_to_ready), endpoint.headers, deployed=endpoint,
                  weights=Path(endpoint.model_path))


def run(targets: list[tuple[str, TargetKind]], plan: Plan, price: pricing.HardwareProfile, measure_quality: bool = True,
        tokenizer: str | None = None, output: Path | None = None, events: Events = lambda *a, **k: None,
        api_key: str | None = None) -> EvaluationResults:
    """Evaluate each (spec, kind) target in turn; kind is endpoint, url or model (deployed here).
    The workload and every target are checked before anything is deployed. Comparing several targets adds an
    equal-work leg to each: the first target's output lengths replayed with end-of-sequence ignored."""
    workloads.check(plan.dataset, tokenizer)
    results = EvaluationResults(
        created_at=time.time(), price=price,
        settings=Settings(concurrency=list(plan.concurrency), requests_per_level=plan.requests_at(max(plan.concurrency)), duration_s=plan.duration_s,
                          min_duration_s=plan.min_duration_s, timeout_s=plan.timeout_s, seed=plan.seed,
                          goodput_targets=plan.goodput),
    )
    work = equal_work = None
    # every target is resolved before anything is deployed or measured: a bad second one fails at once
    resolved = [serving.for_target(spec) if kind == "model" else resolve_target(spec, kind, tokenizer, api_key)
                for spec, kind in targets]
    # measured once per machine, before this run deploys anything (an endpoint given may be running)
    rates = roofline.machine_rates() if any(kind != "url" for _, kind in targets) else None
    for (target_spec, kind), ready in zip(targets, resolved):
        target = deploy_target(target_spec, events, ready) if isinstance(ready, serving.ServingSpec) else ready
        entry = target.result
        try:
            counter = TokenCounter.from_path(entry.tokenizer) if entry.tokenizer else None
            if counter is None:
                entry.warning = "no tokenizer: token counts come from the server's usage fields"
            if work is None:
                work = plan.workload(counter)
                results.workload = work.describe()
            entry.levels = levels.run(entry.url, entry.served_name, work, counter, plan, price, target.headers, entry.label, events)
            decode_bounds(entry.levels, target.weights, entry.engine, rates)
            entry.aborted = next((level.aborted for level in entry.levels if level.aborted), None)
            if len(targets) > 1 and entry.aborted is None:
                if equal_work is None:  # the reference's lengths, replayed on every target (itself included)
                    equal_work = work if work.ignore_eos else work.with_lengths(levels.output_lengths(entry.levels))
                entry.equal_work = entry.levels if equal_work is work else levels.run(
                    entry.url, entry.served_name, equal_work, counter, plan, price, target.headers, f"{entry.label} (equal work)", events)
                entry.aborted = next((level.aborted for level in entry.equal_work if level.aborted), None)
            if measure_quality and entry.aborted is None:
                events("quality", target=entry.label)
                entry.quality = measure(entry, target.headers, results.targets[0].quality if results.targets else None)
        finally:
            if target.deployed is not None:
                target.deployed.stop()
        results.targets.append(entry)
        if len(results.targets) > 1:
            results.comparison = compare.compare(results.targets)
        if output is not None:
            report.write(results, output)
        if entry.aborted:
            break
    return results


def decode_bounds(found: list[Level], weights: Path | None, engine: EngineConfig | None, rates: roofline.Rates | None) -> None:
    """Each level's decode speed against the machine's bound, where one applies. It is a reading,
    not the measurement: weights it cannot read leave it out and lose nothing else."""
    if rates is None or weights is None:
        return
    settings = engine or EngineConfig()
    spec = settings.speculative
    try:
        traffic = roofline.served_traffic(weights, settings, None)
        draft = roofline.served_traffic(Path(spec.model), settings, None) if spec is not None and spec.model else None
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return
    for level in found:
        level.decode_bound = decode_bound(level, traffic, rates, draft)


def speculation(level: Level, draft: roofline.Traffic | None = None) -> roofline.Speculation | None:
    """What the level's decode steps proposed and kept per sequence, averaged over every step. vLLM
    counts only the steps that drafted (its mean accepted length): a step with no n-gram match, or
    above a schedule's batch size, keeps one token and proposes none, so the steps are counted from
    the tokens decoded (each step keeps one, plus what it accepted). None where it did not speculate."""
    spec = level.speculative
    if spec is None:
        return None
    answered = level.invocations - level.invocation_errors - level.empty_responses
    decoded = level.server_counted_tokens.output - answered  # each answer's first token is its prefill's
    steps = decoded - spec.accepted_tokens
    if steps <= 0:
        return None
    return roofline.Speculation(proposed=spec.draft_tokens / steps, accepted_length=decoded / steps, draft=draft)


def decode_bound(level: Level, traffic: roofline.Traffic, rates: roofline.Rates,
                 draft: roofline.Traffic | None = None) -> DecodeBound | None:
    """The level's decode speed against the bound at its batch and mean context; when it speculated,
    a step yields the tokens its steps kept on average, and `draft` (a draft model's weights) adds
    its passes. None where llmopt cannot read the weights, the target's or a draft model's."""
    achieved = level.decode_tokens_per_s
    if not traffic.weights_bytes or achieved is None:
        return None
    speculating = speculation(level, draft)
    if level.speculative is not None and (speculating is None or (draft is not None and not draft.weights_bytes)):
        return None
    per = level.per_request
    context = (per.input_tokens.mean if per.input_tokens else 0) + (per.output_tokens.mean if per.output_tokens else 0) / 2
    bound, limit = roofline.bound_tokens_per_s(traffic, rates, level.concurrency, round(context), speculating)
    return DecodeBound(achieved_tok_s=achieved, bound_tok_s=bound, limited_by=limit,
                       weights_read_per_token_bytes=traffic.weights_bytes, read_gb_s=rates.read_gb_s,
                       accepted_length=speculating.accepted_length if speculating else None)


def measure(target: TargetResult, headers: dict[str, str], reference: Quality | None = None) -> Quality:
    """Perplexity of held-out text and greedy outputs, and how many of the reference's greedy tokens
    this target ranks first given the reference's answer so far; any may be unavailable on a
    foreign server (one without /tokenize, say), and is then recorded as an error."""
    found = Quality()
    try:
        found.perplexity = quality.perplexity(target.url, target.served_name, corpus.heldout_texts(), headers=headers)
    except (httpx.HTTPError, KeyError, TypeError, IndexError) as exc:
        found.perplexity_error = f"{type(exc).__name__}: {exc}"
    try:
        found.greedy_tokens = quality.greedy_tokens(target.url, target.served_name, headers=headers)
    except (httpx.HTTPError, KeyError, TypeError) as exc:
        found.greedy_error = f"{type(exc).__name__}: {exc}"
    if reference is not None and reference.greedy_tokens:
        try:
            found.forced_token_agreement = quality.forced_agreement(target.url, target.served_name, reference.greedy_tokens,
                                                                    headers=headers)
        except (httpx.HTTPError, KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            found.forced_error = f"{type(exc).__name__}: {exc}"
    return found

"""Speculative decoding end to end: n-gram and a draft model (the packaged model drafting for
itself: the plumbing of a real pair, without the 1.5B in CI), verified running, measured per
concurrency, switched off above a batch size, and lossless at temperature 0."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

import llmopt
from llmopt import artifact, endpoints
from llmopt.errors import LlmoptError
from llmopt.evaluation import quality
from llmopt.jobs import store
from llmopt.recipe import DraftModel, NGram, Recipe

from conftest import SMALL_ENGINE


@pytest.fixture(scope="module")
def ngram_job(smol) -> llmopt.Job:
    job = llmopt.optimize(smol.id, Recipe(speculative=NGram(disable_above_batch=2)), name="ngram-job")
    assert job.status == store.COMPLETED, job.record.failure_reason
    return job


def test_ngram_artifact_is_verified_and_lossless(ngram_job: llmopt.Job, baseline: llmopt.Job, endpoint) -> None:
    manifest = artifact.load(ngram_job.artifact)
    config = manifest.engine["args"]["speculative-config"]
    assert config["method"] == "ngram" and config["num_speculative_tokens"] == 4
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 65536, 0]]
    spec = manifest.metrics["speculative"]
    assert spec["drafts"] > 0 and 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] > 1
    # temperature 0, batch 1, same engine: speculation must not change the outputs, except where
    # the base model itself saw a bf16 tie between the two tokens (checked with the base's logprobs)
    base = artifact.load(baseline.artifact).metrics["greedy_tokens"]
    spec_tokens = manifest.metrics["greedy_tokens"]
    agreement = quality.agreement(base, spec_tokens)
    parted = quality.divergences(endpoint.url, endpoint.served_name, AutoTokenizer.from_pretrained(endpoint.model_path),
                                 base, spec_tokens)
    assert all(d["tie"] for d in parted), (agreement, parted)
    assert agreement["identical_outputs"] >= 0.5, (agreement, parted)


def test_ngram_deploy_reports_acceptance_per_concurrency(ngram_job: llmopt.Job) -> None:
    with ngram_job.deploy(name="ngram-ep") as endpoint:
        verified = json.loads(endpoints.get("ngram-ep").verification)["speculative"]
        assert verified["drafts"] > 0 and verified["accepted_tokens"] > 0
        results = llmopt.evaluate(endpoint=endpoint.name, dataset="builtin-qa", concurrency=[1, 4], requests=8, quality=False)
    low, high = results["targets"][0]["levels"]
    assert low["speculative"]["acceptance_rate"] > 0 and low["speculative"]["mean_accepted_length"] > 1
    # above batch 2 the schedule proposes nothing, so batched requests get fewer drafts per token
    per_token = lambda lvl: (lvl["speculative"] or {"drafts": 0})["drafts"] / lvl["server_counted_tokens"]["output"]  # noqa: E731
    assert per_token(high) < per_token(low), (per_token(low), per_token(high))


def test_draft_model_job_with_the_target_as_its_own_draft(smol) -> None:
    job = llmopt.optimize(smol.id, Recipe(speculative=DraftModel(smol.id, num_speculative_tokens=3)), name="draft-job", wait=False)
    assert any("is the target itself" in w for w in job.warnings)
    job.wait()
    assert job.status == store.COMPLETED, job.record.failure_reason
    manifest = artifact.verify(job.artifact)
    assert manifest.references["draft"] == {"model": smol.id, "content_hash": smol.content_hash, "path": "draft"}
    assert (job.artifact / "draft" / "model.safetensors").exists()
    config = manifest.engine["args"]["speculative-config"]
    assert config == {"method": "draft_model", "model": "./draft", "num_speculative_tokens": 3}
    assert manifest.serving_spec().engine_args["speculative-config"]["model"] == str(job.artifact / "draft")
    # a draft identical to the target is accepted almost always
    assert manifest.metrics["speculative"]["acceptance_rate"] > 0.9


def test_speculation_configured_but_not_running_is_an_error(smol) -> None:
    """A schedule that proposes no drafts at batch 1: the deploy fails instead of serving silently."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
              "num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 64, 4]]}
    engine = SMALL_ENGINE.model_copy(update={"speculative_config": config})
    with pytest.raises(LlmoptError, match="proposed no drafts"):
        llmopt.deploy(smol.id, name="spec-off", engine=engine)
    record = endpoints.get("spec-off")
    assert record.status == endpoints.FAILED and "proposed no drafts" in record.failure_reason

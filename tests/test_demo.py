"""The README's main job, `llmopt demo`, on the real engine and the packaged model."""

from __future__ import annotations

from llmopt import endpoints, procs

from conftest import run_cli


def test_demo_prints_real_answers_and_stops(smol) -> None:
    result = run_cli("demo", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "ready at http://127.0.0.1:" in out
    assert "Paris" in out  # the first question's answer, from the real model
    assert "stopped" in out
    demo_endpoints = [e for e in endpoints.list_endpoints() if e.name.startswith(smol.id)]
    assert demo_endpoints and all(e.status == endpoints.STOPPED for e in demo_endpoints)
    assert not any(procs.is_alive(e.pid, e.pid_create_time) for e in demo_endpoints)

"""Everything llmopt reads from a user or a file, fed anything: a typed result or an LlmoptError
(a bad JSONL line: ValueError, which its reader counts), never another exception."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmopt import artifact, jsonl, recipe
from llmopt.engine import vllm
from llmopt.errors import LlmoptError
from llmopt.evaluation import workload

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)
SECTION_KEYS = st.sampled_from(["name", "quantization", "kv_cache", "speculative", "compilation", "sharding",
                                "chunked_prefill", "method", "dtype", "model", "sweep", "calibration", "group_size",
                                "num_speculative_tokens", "disable_above_batch", "max_model_len", "tensor_parallel_size"])
RECIPE_LIKE = st.recursive(
    st.none() | st.integers(-5, 10**30) | st.text(max_size=12) | st.sampled_from(["awq", "smoothquant", "fp8", "ngram",
                                                                                  "draft_model", "auto", "never"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SECTION_KEYS, inner, max_size=4),
    max_leaves=25,
)
HOSTILE_LINES = st.sampled_from([b'{"prompt": 1e999}', b'{"prompt": "x", "max_tokens": Infinity}', b"[" * 5000 + b"]" * 5000,
                                 b'{"messages": [{"role": "user", "content": NaN}]}', b'{"prompt": "\\ud800"}',
                                 b'{"prompt": "ok", "max_tokens": 1e30}', b'{"prompt": "ok", "max_tokens": true}', b"\xff\xfe"])
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.one_of(JSON, RECIPE_LIKE))
def test_recipe_data_gives_a_recipe_or_one_error(data: object) -> None:
    try:
        parsed = recipe.parse(data)
    except LlmoptError as exc:
        assert "\n" not in exc.one_line()
        return
    assert recipe.parse(parsed.to_dict()) == parsed  # what parses, round-trips


@FAST
@given(raw=st.binary(max_size=300))
def test_recipe_files_give_a_recipe_or_one_error(raw: bytes, tmp_path_factory) -> None:
    for suffix in (".yaml", ".json"):
        path = tmp_path_factory.mktemp("recipes") / f"r{suffix}"
        path.write_bytes(raw)
        try:
            recipe.load(str(path))
        except LlmoptError:
            pass


@FAST
@given(st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()), HOSTILE_LINES))
def test_a_jsonl_line_is_a_record_or_a_reason(raw: bytes) -> None:
    try:
        line = jsonl.parse(raw, 1)
    except ValueError as exc:
        assert str(exc)
        return
    assert line.messages or line.text
    assert line.max_tokens is None or 0 < line.max_tokens <= jsonl.MAX_TOKENS_LIMIT


@FAST
@given(lines=st.lists(st.one_of(st.binary(max_size=80), HOSTILE_LINES, st.just(b'{"prompt": "fine"}')), max_size=6))
def test_a_workload_file_is_a_workload_or_one_error(lines: list[bytes], tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("data") / "w.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        found = workload.load(str(path))
    except LlmoptError:
        return
    assert found.requests and all(r.max_tokens > 0 for r in found.requests)


@FAST
@given(data=st.one_of(JSON, st.fixed_dictionaries({"schema_version": st.just(artifact.SCHEMA_VERSION)}, optional={
    "name": st.text(max_size=8), "engine": JSON, "recipe": RECIPE_LIKE, "metrics": JSON})))
def test_a_manifest_is_a_manifest_or_one_error(data: object, tmp_path_factory) -> None:
    folder: Path = tmp_path_factory.mktemp("artifact")
    (folder / artifact.MANIFEST).write_text(json.dumps(data))
    try:
        artifact.load(folder)
    except LlmoptError as exc:
        assert "\n" not in exc.one_line()


LOG_LINE = st.builds(lambda who, stamp, text: f"({who} pid=1) INFO {stamp} [x.py:1] {text}",
                     st.sampled_from(["APIServer", "EngineCore", "Worker"]),
                     st.from_regex(r"\d\d-\d\d \d\d:\d\d:\d\d", fullmatch=True),
                     st.sampled_from(["Initializing a V1 LLM engine", "Warming up model for the compilation...",
                                      "Warming up done.", "anything"]))


@FAST
@given(lines=st.lists(st.one_of(LOG_LINE, st.text(max_size=40)), max_size=12), ready=st.floats(0, 1e4))
def test_an_engine_log_gives_start_phases_within_the_start(lines: list[str], ready: float) -> None:
    phases = vllm.start_phases("\n".join(lines), 1_795_477_377.0, ready)
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) <= ready + 0.05 * len(phases) + 1e-6

"""Exports: an artifact rendered for Ray Serve, KServe, Kubernetes and Docker Compose serves exactly
the engine flags and environment llmopt would use on the machine described, passes each system's
own schema or types, and matches the golden files (regenerate them with LLMOPT_UPDATE_GOLDEN=1).

The artifacts are written here, not built by a job: a manifest like a job's, frozen over tiny files."""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes.client import ApiClient

from llmopt import artifact, exports, techniques
from llmopt import recipe as recipes
from llmopt.engine import compile_cache, platform, vllm
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError
from llmopt.evaluation import quality

from conftest import assert_one_line_error, run_cli

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "exports"
SCHEMAS = HERE / "schemas"
UPDATE_GOLDEN = os.environ.get("LLMOPT_UPDATE_GOLDEN") == "1"
SIZE_BYTES = 270_000_000  # the weights and the draft, as the manifest records them
H100 = Hardware(device="cuda", cpu_model="Intel Xeon Platinum 8480+", cores=52, memory_gib=2015.6,
                cpu_flags=("amx_bf16", "avx512f"), gpu="NVIDIA H100 80GB HBM3", gpu_count=2)
EPYC = Hardware(device="cpu", cpu_model="AMD EPYC 9R14", cores=2, memory_gib=24.0, cpu_flags=("avx512f",), gpu=None)
SPECULATION = {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "disable_above_batch": 4}
ARTIFACTS = {  # kind: (recipe, built on, engine)
    "gpu": ({"name": "tp2-draft-kv8", "kv_cache": {"dtype": "fp8"}, "sharding": {"tensor_parallel_size": 2},
             "speculative": SPECULATION}, H100, "vllm"),
    "cpu": ({"name": "draft-kv8", "kv_cache": {"dtype": "fp8"}, "speculative": SPECULATION}, EPYC, "vllm-cpu"),
}
CASES = {  # (artifact, format): the export's arguments
    ("gpu", "ray-serve"): dict(gpus=2, replicas=2, model_uri="file:///shared/artifacts/smol-gpu"),
    ("gpu", "kserve"): dict(gpus=2, replicas=2, model_uri="s3://models/smol-gpu"),
    ("gpu", "kubernetes"): dict(gpus=2, replicas=2, model_uri="pvc://models/artifacts/smol-gpu"),
    ("gpu", "compose"): dict(gpus=2, replicas=2),
    ("cpu", "ray-serve"): dict(cpus=2),
    ("cpu", "kserve"): dict(cpus=2, model_uri="gs://models/smol-cpu"),
    ("cpu", "kubernetes"): dict(cpus=2),
    ("cpu", "compose"): dict(cpus=2),
}
MODEL_DIRS = {"kserve": "/mnt/models", "kubernetes": "/artifact", "compose": "/artifact"}  # ray-serve: the artifact's path


def _write_artifact(parent: Path, kind: str) -> Path:
    recipe_data, built_on, engine_name = ARTIFACTS[kind]
    work = parent / f".build-{kind}"
    for folder in (work, work / "draft"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (folder / "model.safetensors").write_bytes(b"weights of " + folder.name.encode())
    recipe = recipes.parse(recipe_data)
    settings = techniques.engine(recipe)
    if kind == "gpu":
        settings = settings.model_copy(update={"gpu_memory_utilization": 0.85})
    start = compile_cache.Start(key="2" * 64, outcome="compiled", compiled_files_added=12, ready_seconds=31.5)
    manifest = artifact.Manifest(
        name=f"smol-{kind}",
        key="0" * 64,
        source=artifact.SourceRecord(model="smollm2-135m-instruct", origin="catalog", content_hash="1" * 64),
        recipe=recipe,
        engine=artifact.EngineRecord(name=engine_name, version="0.32.0", served_name=f"smol-{kind}", settings=settings),
        hardware=artifact.HardwareRecord(**built_on.model_dump(), torch="2.13.0"),
        metrics=artifact.ArtifactMetrics(ready_seconds=31.5, start=start, greedy_tokens=[[1, 2, 3]],
                                         perplexity=quality.Perplexity(perplexity=12.5, tokens=2048, mean_nll=2.526),
                                         size_bytes=SIZE_BYTES, source_size_bytes=SIZE_BYTES, peak_rss_bytes=1 << 30),
    )
    return artifact.finalize(work, parent / f"smol-{kind}", manifest)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    parent = tmp_path_factory.mktemp("exports")
    return {kind: _write_artifact(parent, kind) for kind in ARTIFACTS}


def _render(artifacts: dict[str, Path], kind: str, fmt: str) -> dict[str, str]:
    return exports.render(artifacts[kind], fmt, **CASES[kind, fmt])  # type: ignore[arg-type]


def _target_hardware(kind: str, fmt: str) -> Hardware:
    """The machine each case describes, as the engine layer is asked to render for it."""
    case = CASES[kind, fmt]
    gpus = case.get("gpus", 0)
    return Hardware(device="cuda" if gpus else "cpu", cpu_model="any", cores=math.ceil(case.get("cpus", gpus + 2)),
                    memory_gib=8, cpu_flags=(), gpu=None, gpu_count=gpus)


def _model_dir(artifacts: dict[str, Path], kind: str, fmt: str) -> str:
    if fmt != "ray-serve":
        return MODEL_DIRS[fmt]
    uri = CASES[kind, fmt].get("model_uri")
    return uri.removeprefix("file://") if uri else str(artifacts[kind])


def _documents(files: dict[str, str]) -> dict[str, Any]:
    return {name: yaml.safe_load(text) for name, text in files.items()}


def _served(fmt: str, docs: dict[str, Any]) -> tuple[list[str] | dict[str, Any], dict[str, str]]:
    """What each format hands vLLM: its arguments (engine kwargs for Ray Serve) and its environment."""
    if fmt == "ray-serve":
        llm = docs["ray-serve.yaml"]["applications"][0]["args"]["llm_configs"][0]
        env = dict(llm["runtime_env"]["env_vars"])
        assert env.pop("LLMOPT_CONTENT_HASH")
        return llm["engine_kwargs"], env
    if fmt == "compose":
        service = next(iter(docs["docker-compose.yaml"]["services"].values()))
        return service["command"], service.get("environment", {})
    if fmt == "kserve":
        container = docs["inferenceservice.yaml"]["spec"]["predictor"]["model"]
    else:
        container = docs["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    return container["args"], {e["name"]: e["value"] for e in container.get("env", [])}


def _as_flags(kwargs: dict[str, Any]) -> list[str]:
    """Engine arguments written the way vLLM's command line takes them."""
    argv: list[str] = []
    for key, value in kwargs.items():
        argv += ["--" + key.replace("_", "-")] + ([] if value is True else
                                                   [json.dumps(value) if isinstance(value, (dict, list)) else str(value)])
    return argv


# -- validators: each format against its own system's schema or types ----------------------------


def _strict(schema: Any) -> Any:
    """A schema whose unknown fields are errors: Kubernetes prunes them from custom resources and Ray
    ignores them, so a misspelt field would otherwise be dropped without a word."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _strict(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        closed["additionalProperties"] = False
    return closed


def _round_trip(doc: dict[str, Any], kind: str) -> None:
    """Through the Kubernetes client's own models: a misspelt or unknown field would be dropped, a
    missing required one refused."""
    client = ApiClient()
    obj = client.deserialize(json.dumps(doc), kind, "application/json")
    assert client.sanitize_for_serialization(obj) == doc


def _validate_ray_serve(docs: dict[str, Any]) -> None:
    schemas = json.loads((SCHEMAS / "ray-serve" / "ray-serve-llm.json").read_text())
    config = docs["ray-serve.yaml"]
    jsonschema.Draft202012Validator(_strict(schemas["serve_config"])).validate(config)
    llm_schema = schemas["llm_config"]
    for application in config["applications"]:
        assert application["import_path"] == "ray.serve.llm:build_openai_app"
        for llm in application["args"]["llm_configs"]:
            jsonschema.Draft202012Validator(llm_schema).validate(llm)
            loading = {"$ref": "#/$defs/ModelLoadingConfig", "$defs": llm_schema["$defs"]}
            jsonschema.Draft202012Validator(loading).validate(llm["model_loading_config"])
            jsonschema.Draft202012Validator(_strict(schemas["deployment_config"])).validate(llm["deployment_config"])
            assert not {"model", "served_model_name"} & set(llm["engine_kwargs"])  # Ray Serve LLM sets those itself


def _validate_kserve(docs: dict[str, Any]) -> None:
    schema = json.loads(gzip.decompress((SCHEMAS / "kserve" / "inferenceservice.v1beta1.json.gz").read_bytes()))
    service = docs["inferenceservice.yaml"]
    jsonschema.Draft7Validator(_strict(schema)).validate(service)
    _round_trip(service["metadata"], "V1ObjectMeta")  # the CRD leaves metadata to the API server


def _validate_kubernetes(docs: dict[str, Any]) -> None:
    _round_trip(docs["deployment.yaml"], "V1Deployment")
    _round_trip(docs["service.yaml"], "V1Service")


def _validate_compose(docs: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(json.loads((SCHEMAS / "compose-spec" / "compose-spec.json").read_text())).validate(
        docs["docker-compose.yaml"])


VALIDATORS = {"ray-serve": _validate_ray_serve, "kserve": _validate_kserve, "kubernetes": _validate_kubernetes,
              "compose": _validate_compose}


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    """vLLM's own server command line (vllm-cpu 0.32's module path)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, fmt", list(CASES))
def test_each_export_passes_its_systems_schema(artifacts: dict[str, Path], kind: str, fmt: str) -> None:
    VALIDATORS[fmt](_documents(_render(artifacts, kind, fmt)))


@pytest.mark.parametrize("kind, fmt", list(CASES))
def test_each_export_serves_the_flags_and_environment_llmopt_would(artifacts: dict[str, Path], kind: str, fmt: str) -> None:
    manifest = artifact.load(artifacts[kind])
    hardware, model_dir = _target_hardware(kind, fmt), _model_dir(artifacts, kind, fmt)
    located = manifest.located_engine(Path(model_dir))
    flags = vllm.flags(located, manifest.engine.served_name, hw=hardware)
    arguments, env = _served(fmt, _documents(_render(artifacts, kind, fmt)))

    if fmt == "ray-serve":
        assert arguments == vllm.engine_kwargs(located, hardware)
        assert _as_flags(arguments) == flags[2:]  # all but the served name, which Ray Serve takes from model_id
    elif fmt == "kserve":
        assert arguments == ["--backend=vllm", *flags]
    else:
        assert arguments == ["--model", model_dir, "--host", "0.0.0.0", "--port", "8000", *flags]
    assert env == vllm.image_environment(manifest.engine.settings, hardware)
    assert f"{model_dir}/draft" in json.dumps(arguments)
    if kind == "gpu":
        assert "--tensor-parallel-size" in flags and "--gpu-memory-utilization" in flags and env == {}
    else:
        assert "--gpu-memory-utilization" not in flags and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


@pytest.mark.parametrize("kind, fmt", list(CASES))
def test_nothing_from_the_build_machine_leaks_into_an_export(artifacts: dict[str, Path], kind: str, fmt: str) -> None:
    text = "\n".join(_render(artifacts, kind, fmt).values())
    assert "LD_PRELOAD" not in text
    for found_here in [*platform.preload_libraries(), sys.prefix, sys.executable]:
        assert found_here not in text
    if (kind, fmt) == ("gpu", "kubernetes"):  # the artifact from a volume claim, not from this machine's disk
        assert str(artifacts[kind]) not in text


@pytest.mark.parametrize("kind, fmt", list(CASES))
def test_each_export_matches_its_golden_files(artifacts: dict[str, Path], kind: str, fmt: str) -> None:
    files = {name: text.replace(str(artifacts[kind]), f"/path/to/smol-{kind}")
             for name, text in _render(artifacts, kind, fmt).items()}
    folder = GOLDEN / f"{kind}-{fmt}"
    if UPDATE_GOLDEN:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    assert sorted(p.name for p in folder.iterdir()) == sorted(files), "run with LLMOPT_UPDATE_GOLDEN=1 to regenerate"
    for name, text in files.items():
        assert (folder / name).read_text() == text, f"{folder.name}/{name} differs; LLMOPT_UPDATE_GOLDEN=1 regenerates it"


@pytest.mark.parametrize("kind, fmt", [c for c in CASES if c[1] != "ray-serve"])
def test_vllm_parses_every_exported_command_line(artifacts: dict[str, Path], vllm_parser: Any, kind: str, fmt: str) -> None:
    arguments, _env = _served(fmt, _documents(_render(artifacts, kind, fmt)))
    parsed = vllm_parser.parse_args([a for a in arguments if a != "--backend=vllm"])  # KServe's runtime's own flag
    assert parsed.kv_cache_dtype == "fp8"
    assert parsed.speculative_config["model"] == f"{_model_dir(artifacts, kind, fmt)}/draft"
    assert parsed.tensor_parallel_size == (2 if kind == "gpu" else 1)
    if kind == "gpu":
        assert parsed.gpu_memory_utilization == 0.85


@pytest.mark.parametrize("kind", list(ARTIFACTS))
def test_ray_serve_engine_kwargs_are_vllm_engine_arguments(artifacts: dict[str, Path], kind: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    kwargs, _env = _served("ray-serve", _documents(_render(artifacts, kind, "ray-serve")))
    assert isinstance(kwargs, dict)
    engine_args = EngineArgs(model=_model_dir(artifacts, kind, "ray-serve"), **kwargs)  # an unknown argument is a TypeError
    taken = {key: getattr(engine_args, key) for key in kwargs}
    if "compilation_config" in kwargs:  # which vLLM parses into its CompilationConfig
        asked = kwargs.pop("compilation_config")["inductor_compile_config"]
        assert taken.pop("compilation_config").inductor_compile_config.items() >= asked.items()
    assert taken == kwargs


def test_resources_default_to_the_model_size(artifacts: dict[str, Path]) -> None:
    """Memory: weights, the KV cache on CPU and 2 GiB; CPUs: the cores it was measured on, or one per
    GPU worker plus two."""
    weights = SIZE_BYTES / 2**30
    cpu = exports.target.describe(artifacts["cpu"])
    gpu = exports.target.describe(artifacts["gpu"], gpus=2)
    assert (cpu.cpus, cpu.memory_gib) == (EPYC.cores, math.ceil(weights + 2 + 2))
    assert (gpu.cpus, gpu.memory_gib) == (4, math.ceil(weights + 2))
    assert exports.target.describe(artifacts["cpu"], cpus=3.5, memory_gib=6).hardware.cores == 4


def test_the_manifest_hash_marks_every_export(artifacts: dict[str, Path]) -> None:
    content_hash = artifact.load(artifacts["gpu"]).content_hash
    for (kind, fmt) in CASES:
        if kind == "gpu":
            assert all(content_hash in text for text in _render(artifacts, kind, fmt).values()), fmt
    docs = _documents(_render(artifacts, "gpu", "kubernetes"))
    pod = docs["deployment.yaml"]["spec"]["template"]["metadata"]
    assert pod["annotations"]["llmopt/content-hash"] == content_hash


@pytest.mark.parametrize("kind, fmt, arguments, needle", [
    ("gpu", "kubernetes", {}, "pass gpus=2"),
    ("gpu", "kubernetes", {"gpus": 1}, "pass gpus=2"),
    ("cpu", "compose", {"gpus": 2}, "pass gpus=1"),
    ("cpu", "kserve", {}, "no model URI"),
    ("cpu", "compose", {"model_uri": "s3://models/smol-cpu"}, "cannot fetch"),
    ("cpu", "kubernetes", {"model_uri": "s3://models/smol-cpu"}, "pvc://"),
    ("cpu", "ray-serve", {"model_uri": "s3://models/smol-cpu"}, "file://"),
    ("cpu", "ray-serve", {"image": "my/vllm:1"}, "cluster's image"),
    ("cpu", "kserve", {"model_uri": "not a uri"}, "not a URI"),
    ("cpu", "compose", {"replicas": 0}, "replicas"),
    ("cpu", "compose", {"cpus": -1}, "positive"),
    ("cpu", "helm", {}, "unknown export format"),
])
def test_impossible_exports_are_refused(artifacts: dict[str, Path], kind: str, fmt: str, arguments: dict[str, Any],
                                        needle: str) -> None:
    with pytest.raises(LlmoptError, match=needle):
        exports.render(artifacts[kind], fmt, **arguments)  # type: ignore[arg-type]


def test_export_writes_the_files(artifacts: dict[str, Path], tmp_path: Path) -> None:
    written = exports.export(artifacts["gpu"], "kubernetes", tmp_path / "out", gpus=2, model_uri="pvc://models/smol-gpu")
    assert sorted(p.name for p in written) == ["deployment.yaml", "service.yaml"]
    assert all(p.read_text().startswith("# llmopt export of artifact 'smol-gpu'") for p in written)


def test_the_export_command_writes_or_refuses_in_one_line(artifacts: dict[str, Path], tmp_path: Path) -> None:
    done = run_cli("export", str(artifacts["cpu"]), "--format", "compose", "--output", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert [Path(line).name for line in done.stdout.split()] == ["docker-compose.yaml"]
    assert_one_line_error(run_cli("export", str(artifacts["gpu"]), "--format", "kubernetes", "-o", str(tmp_path)), "gpus=2")
    assert_one_line_error(run_cli("export", str(tmp_path), "--format", "compose", "-o", str(tmp_path)), "not an llmopt artifact")

"""The Python SDK: the whole of what llmopt does, as functions. The CLI and the studio call these
and nothing else, so a feature exists once, here.

    import llmopt
    job = llmopt.optimize("smollm2-135m-instruct", "smoothquant")
    with job.deploy() as endpoint:
        results = llmopt.evaluate(endpoint=endpoint.name, concurrency=[1, 4])
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import ValidationError

from llmopt import artifact, catalog, compatibility, coverage, endpoints, executors, exports, locations, names, serving, sources
from llmopt import recipe as recipes
from llmopt.endpoints import Endpoint
from llmopt.engine import compile_cache, platform, vllm
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError, first_invalid
from llmopt.evaluation import levels, pricing, runs
from llmopt.evaluation import results as evaluation_results_module
from llmopt.evaluation import workload as workloads
from llmopt.evaluation.levels import Events, Plan
from llmopt.evaluation.results import EvaluationResults
from llmopt.jobs import runner, store
from llmopt.jobs.runner import Job
from llmopt.jobs.store import JobRecord
from llmopt.presentation import recommendation as recommendation_report
from llmopt.presentation import report
from llmopt.recommendation import configs as deployment_configs
from llmopt.recommendation import ranking, search
from llmopt.techniques import speculative
from llmopt.sources import Model

DEFAULT_MODEL = catalog.DEFAULT_MODEL
DEFAULT_HOST = vllm.DEFAULT_HOST
DEFAULT_READY_TIMEOUT_S = endpoints.DEFAULT_READY_TIMEOUT_S
JOB_STATUSES, ENDPOINT_STATUSES, ACTIVE_JOB_STATUSES = store.STATUSES, endpoints.STATUSES, store.ACTIVE
LIVE_ENDPOINT_STATUSES, ACTIVE_EVALUATION_STATUSES = endpoints.LIVE, runs.ACTIVE
JOB_EXECUTORS = executors.NAMES

__all__ = [
    "DEFAULT_MODEL", "Endpoint", "EngineConfig", "EvaluationResults", "Job", "JobRecord", "LlmoptError", "Model",
    "catalog_models", "compatibility_matrix", "coverage_matrix", "config_listing", "config_warnings", "config_verdicts", "demo_recipe", "deploy", "configs",
    "recommend", "list_evaluations", "get_evaluation", "stop_evaluation", "evaluation_logs", "evaluation_plan", "evaluation_results", "engine_config", "endpoint_logs", "evaluate", "export_command", "export_deployment", "EXPORT_FORMATS", "get_endpoint",
    "get_job", "get_model", "import_model", "job_logs", "kept_kernels", "list_cache", "list_endpoints", "list_jobs", "list_models",
    "list_recipes", "load_recipe", "load_results", "optimize", "prune_cache", "recipe_from_flags", "recipe_schema",
    "remove_model", "resolve_model", "stop_endpoint", "stop_job", "JOB_EXECUTORS",
]


# -- models -------------------------------------------------------------------------------------


def import_model(spec: str, name: str | None = None, chat_template: str | Path | None = None) -> Model:
    """Import a catalogue id, a Hugging Face folder or a GGUF file into the model store, checked;
    `chat_template` (a Jinja file) for a model that has none of its own."""
    return sources.import_model(spec, name=name, chat_template=chat_template)


def resolve_model(spec: str) -> Model:
    """An imported model by id or store path, or a catalogue id, folder or GGUF file, imported on first use."""
    return sources.resolve(spec)


def coverage_matrix() -> tuple[list[str], list[list[str]]]:
    """The supported-models matrix, from runs on this machine kind (`benchmarks/coverage.py`)."""
    return coverage.matrix(coverage.load())


def list_models() -> list[Model]:
    return sources.list_models()


def catalog_models() -> list[catalog.CatalogModel]:
    """The models llmopt knows by id (imported on first use)."""
    return [catalog.get(i) for i in catalog.ids()]


def get_model(model_id: str) -> Model:
    model = sources.get(model_id)
    if model is None:
        raise LlmoptError(f"no imported model named '{model_id}'", "see `llmopt models list`")
    return model


def remove_model(model_id: str) -> None:
    sources.remove(model_id)


# -- recipes ------------------------------------------------------------------------------------


def list_recipes() -> dict[str, Any]:
    """The built-in recipes, by name."""
    return {name: recipes.load(name) for name in recipes.BUILTIN}


def load_recipe(spec: str | Path) -> Any:
    """A built-in recipe by name, or a YAML/JSON recipe file."""
    return recipes.load(spec)


def recipe_from_flags(base: Any, quantize: str | None = None, kv_cache: str | None = None, speculative: str | None = None,
                      compile: bool = False, tensor_parallel: int | None = None) -> Any:
    """A recipe with whole sections replaced by the command line's shortcut flags."""
    flags = recipes.flag_overrides(quantize, kv_cache, speculative, compile, tensor_parallel)
    return base.merged(flags) if flags else base


def demo_recipe(model: str, concurrency: tuple[int, ...] = (1, 4)) -> Any:
    """What the main job optimizes with unless told otherwise: what pays on this processor by the
    compatibility matrix's measured facts. SmoothQuant (INT8) where the matrix marks it fast here,
    stacked with the catalogue's speculation for the model (n-gram, or its draft), swept at the
    levels the demo compares."""
    source = sources.resolve(model)
    hardware, verdict = platform.detect(), compatibility.Verdict()
    architecture = source.architecture or "unknown"

    def fast_here(technique: str) -> bool:
        row = compatibility.apply(technique, architecture, hardware, verdict)
        return row is not None and row.status == "supported"

    sections: dict[str, Any] = {}
    if fast_here("quantization.smoothquant"):
        sections["quantization"] = {"method": "smoothquant"}
    catalogued = speculative.catalog_id(source)
    method = "draft_model" if catalogued and catalog.get(catalogued).recommended_draft != "ngram" else "ngram"
    if fast_here(f"speculative.{method}"):
        sections["speculative"] = {"method": method, "sweep": {"concurrency": list(concurrency)}}
    name = "-".join(s["method"].replace("_model", "") for s in sections.values()) or "baseline"
    return recipes.parse({"name": name, **sections}, origin="demo recipe")


def recipe_schema() -> dict[str, Any]:
    return recipes.schema()


def compatibility_matrix() -> tuple[compatibility.Row, ...]:
    return compatibility.matrix()


# -- optimize and jobs --------------------------------------------------------------------------


def optimize(model: str, recipe: Any = "baseline", name: str | None = None, output: str | None = None,
             force: bool = False, wait: bool = True, executor: str = "local", ray_address: str | None = None) -> Job:
    """Run a recipe on a model in a background job that writes one self-contained artifact.

    `recipe` is a Recipe, a built-in name, a file, or a dict. The same recipe on the same source
    reuses the earlier artifact unless `force` is set. `executor` is where the job's worker runs:
    "local" (a background process here) or "ray" (a Ray job on the cluster whose dashboard is at
    `ray_address`, default http://127.0.0.1:8265). `output` is a folder, or an fsspec URI
    (file://, s3://...) every node reads: the job publishes there, checked, and deploys fetch from it.
    """
    if isinstance(recipe, (str, Path)):
        recipe = recipes.load(recipe)
    elif isinstance(recipe, dict):
        recipe = recipes.parse(recipe)
    job = runner.create(model, recipe, name=name, output=output, force=force, executor=executor, ray_address=ray_address)
    return job.wait() if wait else job


def list_jobs(status: str | None = None, name_contains: str | None = None) -> list[JobRecord]:
    return store.list_jobs(status, name_contains)


def get_job(name: str) -> JobRecord:
    return store.get(name)


def stop_job(name: str) -> JobRecord:
    return runner.stop(name)


def job_logs(name: str, follow: bool = False) -> Iterator[str]:
    """A job's log lines; with `follow`, as they are written, until the job ends."""
    return _lines(Path(store.get(name).log_path), follow, lambda: store.get(name).status in store.ACTIVE)


# -- deploy and endpoints -----------------------------------------------------------------------


def deploy(
    model: str,
    name: str | None = None,
    port: int | None = None,
    host: str = DEFAULT_HOST,
    engine: EngineConfig | None = None,
    timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    api_key: str | None = None,
    insecure: bool = False,
    trust_remote_code: bool = False,
    chat_template: str | Path | None = None,
    config: str | None = None,
    trust_compiled_code: bool = False,
) -> Endpoint:
    """Serve a model or an optimized artifact; returns once the endpoint answers.

    `model` is an artifact folder, an imported model, a catalogue id, a Hugging Face folder or a
    GGUF file (the last three are imported on first use). With `config`, one of the model's
    deployment configurations (`configs(model)`): its artifact is built, or reused by key, then
    served. With `api_key` every route asks for it (`endpoint.headers` carries it); a host other
    than loopback needs one, or `insecure`. An artifact no job of this home built starts by
    compiling, unless `trust_compiled_code` lets the compiled code it ships (code the engine runs) load.
    """
    endpoints.check_request(name or "endpoint", host, port, api_key, insecure, timeout_s)  # before a first-use import
    if config is not None:
        if engine is not None or trust_remote_code or chat_template is not None:
            raise LlmoptError("a deployment configuration carries its own settings",
                              "deploy it without engine settings, remote code or a chat template")
        model = str(_configured_artifact(model, config))
    return serving.deploy(serving.for_target(model, engine), name=name, port=port, host=host, timeout_s=timeout_s,
                          api_key=api_key, insecure=insecure, trust_remote_code=trust_remote_code, chat_template=chat_template,
                          trust_compiled_code=trust_compiled_code)


def _configured_artifact(model: str, config: str) -> Path:
    """The artifact of a model's deployment configuration, built by an ordinary job or reused by key."""
    source = sources.resolve(model)
    listed = configs(source.id)
    chosen = deployment_configs.named(listed, source.id, config)
    listed_verdicts = config_verdicts(listed)
    verdict = next(v for c, v in zip(listed, listed_verdicts) if c is chosen)
    if verdict.refusals:
        runs_here = list(dict.fromkeys(c.name for c, v in zip(listed, listed_verdicts) if not v.refusals))
        raise LlmoptError(f"configuration '{config}' cannot run on this machine: {verdict.refusals[0]}",
                          (f"deploy one that can ({', '.join(runs_here)}), or m" if runs_here else "M")
                          + f"easure this machine's own with `llmopt recommend {source.id}`")
    job = optimize(source.id, {"name": names.slug(config)[:30], **chosen.recipe})
    if job.artifact is None:
        record = job.record
        raise LlmoptError(f"the job for configuration '{config}' ended {record.status}: {record.failure_reason}",
                          f"see `llmopt jobs logs {job.name}`")
    return job.artifact


def configs(model: str) -> list[deployment_configs.DeploymentConfig]:
    """A model's deployment configurations: those measured on this kind of machine first, the user's
    before the shipped ones. Imports nothing, so a catalogued model's shipped ones read before its
    packages are installed, as a user choosing would."""
    if catalog.is_catalog_id(model):
        return deployment_configs.for_model(model, platform.detect())
    found = sources.find(model)
    if found is None:
        raise LlmoptError(f"no imported model '{model}' to list configurations of",
                          "give an imported model's id (`llmopt models list`) or a catalogue id")
    return deployment_configs.for_model(found.id, platform.detect())


def config_warnings(found: list[deployment_configs.DeploymentConfig], here: platform.Hardware | None = None) -> list[str]:
    """What to say of configurations whose rows were measured on another kind of machine than
    `here` (this one when None): one line for each such machine, naming its configurations."""
    here = here or platform.detect()
    by_machine: dict[str, list[deployment_configs.DeploymentConfig]] = {}
    for config in found:
        differences = here.differences(config.hardware)
        if differences:
            by_machine.setdefault("; ".join(differences), []).append(config)
    return [f"{'configuration' if len(group) == 1 else 'configurations'} {', '.join(repr(c.name) for c in group)} "
            f"{'was' if len(group) == 1 else 'were'} measured on another kind of machine ({differences}): "
            f"{'its' if len(group) == 1 else 'their'} rows may not hold here. Measure them here with: llmopt recommend {group[0].model}"
            for differences, group in by_machine.items()]


def config_verdicts(found: list[deployment_configs.DeploymentConfig]) -> list[compatibility.Verdict]:
    """What the compatibility matrix says of each configuration's recipe here, in order: `deploy`
    refuses one it refuses before anything is built, and warns of what it marks slow."""
    here = platform.detect()
    architectures = {model: _architecture(model) for model in {c.model for c in found}}
    return [c.verdict_here(architectures[c.model], here) for c in found]


def config_listing(found: list[deployment_configs.DeploymentConfig]) -> list[dict[str, Any]]:
    """Each configuration as JSON with the `machine` it was measured on (processor and signature)
    and what holds for it here: `warning` when it was measured on
    another kind of machine, the matrix's `refusals` (deploying it is refused) and what it marks
    `slow`. What `configs list --json` prints and the studio shows."""
    here = platform.detect()
    return [{**c.model_dump(mode="json"), "machine": c.hardware.cpu_label, "warning": next(iter(config_warnings([c], here)), None),
             "refusals": verdict.refusals, "slow": verdict.warnings} for c, verdict in zip(found, config_verdicts(found))]


def _architecture(model: str) -> str:
    found = sources.find(model)
    if found is not None:
        return found.architecture or "unknown"
    # a catalogued model not imported yet: its configurations read before its packages are installed
    return catalog.get(model).architecture if catalog.is_catalog_id(model) else "unknown"


def recommend(
    model: str,
    goal: str = "balanced",
    slos: list[str] | tuple[str, ...] = (),
    max_quality_loss: float | None = None,
    dataset: str = "builtin-qa",
    concurrency: tuple[int, ...] | list[int] = (1, 2, 4, 8),
    requests: int = 8,
    min_duration_s: float = 10.0,
    budget_minutes: float | None = None,
    recipes: list[str] | tuple[str, ...] = (),
    output: str | Path | None = None,
    events: Events | None = None,
    executor: str = "local",
    ray_address: str | None = None,
) -> search.Recommendation:
    """Try the candidates the compatibility matrix allows for this model here, each as a job and an
    equal-work load test at every level, rank them for `goal` under the service-level targets
    (`slos`, e.g. "ttft_p90_ms=800"), and keep them as deployment configurations. Resumes a run with
    the same arguments; `budget_minutes` drops the most expensive candidates by estimate first.
    `executor="ray"` builds every candidate's job on a Ray cluster at once; the load tests stay here,
    one after another, so that they measure this machine."""
    events = events or (lambda *a, **k: None)
    workloads.check(dataset)
    executors.choose(executor, ray_address)
    spec = _validated(search.RecommendSpec, "recommend setting", "see `llmopt recommend --help`", dict(
        model=model, goal=goal, slos=tuple(ranking.SLO.parse(s) for s in slos), max_quality_loss=max_quality_loss,
        dataset=dataset, concurrency=tuple(concurrency), requests=requests, min_duration_s=min_duration_s,
        budget_minutes=budget_minutes, recipes=tuple(recipes), executor=executor, ray_address=ray_address))
    rec = search.start(spec)
    search.fit_budget(rec)
    events("estimates", recommendation=rec)
    rec = search.run(rec, events)
    if output is not None:
        recommendation_report.write(rec, Path(output))
    return rec


def list_endpoints(status: str | None = None) -> list[Endpoint]:
    return endpoints.list_endpoints(status)


def get_endpoint(name: str) -> Endpoint:
    return endpoints.get(name)


def stop_endpoint(name: str) -> Endpoint:
    return endpoints.stop(name)


def endpoint_logs(name: str, follow: bool = False) -> Iterator[str]:
    """An endpoint's log lines; with `follow`, as they are written, until it stops."""
    return _lines(Path(endpoints.get(name).log_path), follow, lambda: endpoints.get(name).status in endpoints.LIVE)


def export_command(artifact_dir: str, host: str = DEFAULT_HOST, port: int = 8000) -> str:
    """The plain vLLM command that serves an artifact (a folder, or a URI fetched here) without llmopt, on this machine."""
    if not locations.exists(artifact_dir):
        raise LlmoptError(f"'{artifact_dir}' is not an llmopt artifact (no {artifact.MANIFEST})", "pass an artifact folder or URI")
    spec = serving.for_target(artifact_dir)
    argv = vllm.server_argv(spec.model_path, spec.engine, spec.served_name, host, port)
    return vllm.shell_command(argv, vllm.plain_environment(spec.engine, platform.detect()))


EXPORT_FORMATS = exports.FORMATS


def export_deployment(artifact_dir: str | Path, fmt: exports.Format, output: str | Path, replicas: int = 1,
                      cpus: float | None = None, memory_gib: float | None = None, gpus: int = 0,
                      image: str | None = None, model_uri: str | None = None) -> list[Path]:
    """Write an artifact's deployment for Ray Serve, KServe, Kubernetes or Docker Compose into the
    folder `output`, for the machine described (unset resources: derived from the manifest), so a
    cluster serves it with the engine settings llmopt verified. An artifact at a URI is fetched
    here to be read, and the deployment fetches it from that URI. Returns the files written."""
    if locations.is_uri(artifact_dir):
        model_uri = model_uri or str(artifact_dir)
        artifact_dir = locations.fetch(str(artifact_dir))
    return exports.export(artifact_dir, fmt, output, replicas, cpus, memory_gib, gpus, image, model_uri)


# -- the compile cache --------------------------------------------------------------------------


def list_cache() -> list[compile_cache.EntryInfo]:
    return [compile_cache.describe(entry) for entry in compile_cache.list_entries()]


def kept_kernels() -> list[compile_cache.KeptKernels]:
    """The C++ kernels the compile cache keeps beside its entries, shared by them, per torch version."""
    return compile_cache.kept_kernels()


def prune_cache(older_than_days: float | None = 30.0) -> list[compile_cache.EntryInfo]:
    """Remove entries unused for this long (every entry when None), never one a live endpoint
    started from; returns what was removed."""
    if older_than_days is not None and older_than_days < 0:
        raise LlmoptError(f"--older-than-days {older_than_days:g} is negative", "pass a number of days, or --all")
    return compile_cache.prune(None if older_than_days is None else older_than_days * 86400,
                               keep=endpoints.compile_cache_keys_in_use())


# -- evaluate -----------------------------------------------------------------------------------


def evaluate(
    endpoint: str | None = None,
    url: str | None = None,
    model: str | None = None,
    compare: list[str] | None = None,
    dataset: str = "builtin-qa",
    concurrency: tuple[int, ...] | list[int] = (1, 4),
    requests: int | None = 16,
    duration_s: float | None = None,
    min_duration_s: float = levels.MIN_DURATION_S,
    output: str | Path | None = None,
    hardware: str | None = None,
    price_per_hour: float | None = None,
    discount: float | None = None,
    hardware_file: str | Path | None = None,
    quality: bool = True,
    tokenizer: str | None = None,
    ttft_target_ms: float | None = None,
    itl_target_ms: float | None = None,
    timeout_s: float = 300.0,
    seed: int = 0,
    events: Events | None = None,
    api_key: str | None = None,
    name: str | None = None,
    background: bool = False,
    executor: str = "local",
    ray_address: str | None = None,
) -> EvaluationResults | runs.EvaluationRecord:
    """Load-test one target (an endpoint, a URL, or a model/artifact deployed for the run), or
    compare several models/artifacts deployed in turn (throughput on equal work, latency on the
    natural leg, each ratio with its interval). A level runs at least 4 requests per concurrent
    user and at least `min_duration_s` seconds. Writes OUTPUT/results.json and
    OUTPUT/report.html when `output` is given. `api_key` is for a --url server that asks for one
    (llmopt's own endpoints pass theirs).

    Every evaluation is recorded (`list_evaluations`), its results kept under its name. With
    `background`, it runs in a worker process of its own and this returns its record at once.
    `executor="ray"` runs that worker as a Ray job (`ray_address`: the dashboard's, as for
    `optimize`); without `background` this then waits for it and returns its results."""
    chosen: list[tuple[str, Literal["endpoint", "url", "model"]]] = [
        (v, k) for v, k in ((endpoint, "endpoint"), (url, "url"), (model, "model")) if v  # type: ignore[misc]
    ]
    if compare:
        chosen += [(item, "model") for item in compare]
    if not chosen or (len(chosen) > 1 and not compare):
        raise LlmoptError("name what to evaluate", "pass exactly one of --endpoint, --url, --model, or --compare A B ...")
    plan = evaluation_plan(tokenizer, dataset=dataset, concurrency=tuple(concurrency), requests=None if duration_s else requests,
                           duration_s=duration_s, min_duration_s=min_duration_s, timeout_s=timeout_s, seed=seed,
                           goodput={"ttft_ms": ttft_target_ms, "itl_ms": itl_target_ms})
    price = pricing.choose(hardware, price_per_hour, discount, Path(hardware_file) if hardware_file else None)
    name = names.check(name, "evaluation") if name else f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    runs_on = executors.choose(executor, ray_address)
    runs.create(name, {"targets": chosen, "plan": plan.model_dump(mode="json"), "price": price.model_dump(mode="json"),
                       "quality": quality, "tokenizer": tokenizer, "api_key": api_key}, executor=runs_on.name)
    if background or runs_on.name != "local":
        runs.spawn(name, runs_on)
        if background:
            return runs.get(name)
        ended = runs.wait(name)
        if ended.status != runs.COMPLETED:
            raise LlmoptError(f"evaluation '{name}' ended {ended.status}: {ended.failure_reason}", f"see `llmopt evaluations logs {name}`")
        results = evaluation_results(name)
    else:
        results = runs.execute(name, events)
    if output is not None:
        report.write(results, Path(output))
    return results


def list_evaluations(status: str | None = None) -> list[runs.EvaluationRecord]:
    return runs.list_runs(status)


def get_evaluation(name: str) -> runs.EvaluationRecord:
    return runs.get(name)


def stop_evaluation(name: str) -> runs.EvaluationRecord:
    return runs.stop(name)


def evaluation_logs(name: str, follow: bool = False) -> Iterator[str]:
    return _lines(Path(runs.get(name).log_path), follow, lambda: runs.get(name).status in runs.ACTIVE)


def evaluation_results(name: str) -> EvaluationResults:
    """A recorded evaluation's results (as far as it got, while it runs)."""
    record = runs.get(name)
    if not record.results_file.is_file():
        raise LlmoptError(f"evaluation '{name}' has no results yet ({record.status})", "wait for its first level to finish")
    return evaluation_results_module.load(record.results_file)


def load_results(path: str | Path) -> EvaluationResults:
    """An evaluation's results.json (a folder holding one, or the file)."""
    path = Path(path)
    return evaluation_results_module.load(path / "results.json" if path.is_dir() else path)


def engine_config(**settings: Any) -> EngineConfig:
    """Engine settings, with a bad value refused in one line."""
    return _validated(EngineConfig, "engine setting", "see `llmopt deploy --help`", settings)


def evaluation_plan(tokenizer: str | None = None, **fields: Any) -> Plan:
    """An evaluation's settings, checked, its dataset too (a synthetic one in full with `tokenizer`):
    a command that builds before it evaluates (the demo) refuses bad ones before it builds."""
    plan = _validated(Plan, "evaluation setting", "see `llmopt evaluate --help`", fields)
    workloads.check(plan.dataset, tokenizer)
    return plan


def _validated(model: Any, what: str, fix: str, fields: dict[str, Any]) -> Any:
    try:
        return model(**fields)
    except ValidationError as exc:
        where, problem = first_invalid(exc.errors())
        raise LlmoptError(f"bad {what} {where}: {problem}" if where else f"bad {what}: {problem}", fix) from None


def _lines(path: Path, follow: bool, alive: Any) -> Iterator[str]:
    if not path.exists():
        return iter(())
    if not follow:
        return iter(path.read_text(errors="replace").splitlines(keepends=True))
    return endpoints.follow(path, alive)


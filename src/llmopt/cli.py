"""The `llmopt` command: typer commands over the SDK, with presentation. Nothing else.

Every `list` and `describe` command takes `--json`, for scripts (a terminal table folds long names
when it is not on a terminal).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import click
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from llmopt import sdk
from llmopt.presentation import recommendation, terminal
from llmopt.presentation.format import megabytes, when
from llmopt.presentation.report import REPORT_FILE, RESULTS_FILE
from llmopt.presentation.verdict import verdict

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Optimize, evaluate and deploy LLMs on vLLM.")
models_app = typer.Typer(no_args_is_help=True, help="The model store.")
endpoints_app = typer.Typer(no_args_is_help=True, help="Running endpoints.")
jobs_app = typer.Typer(no_args_is_help=True, help="Optimization jobs.")
recipes_app = typer.Typer(no_args_is_help=True, help="Recipes and the compatibility matrix.")
cache_app = typer.Typer(no_args_is_help=True, help="The compile cache: compiled engine code, one entry per key.")
configs_app = typer.Typer(no_args_is_help=True, help="Deployment configurations: recipes with measured benchmark rows.")
evaluations_app = typer.Typer(no_args_is_help=True, help="Evaluation runs: every evaluate has a record.")
app.add_typer(models_app, name="models")
app.add_typer(endpoints_app, name="endpoints")
app.add_typer(jobs_app, name="jobs")
app.add_typer(recipes_app, name="recipes")
app.add_typer(cache_app, name="cache")
app.add_typer(configs_app, name="configs")
app.add_typer(evaluations_app, name="evaluations")

PIPED_WIDTH = 200  # rich gives output that is not a terminal 80 columns, which squeezes the wide tables to a letter a line


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH)


console = _console()
err = _console(stderr=True)
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")


@app.callback()
def _root(
    home: Optional[Path] = typer.Option(None, "--home", envvar="LLMOPT_HOME", help="llmopt's state folder (models, records, logs)."),
) -> None:
    if home is not None:
        os.environ["LLMOPT_HOME"] = str(home.expanduser().resolve())


@contextmanager
def _working(text: str) -> Iterator[None]:
    """A spinner with elapsed time for anything that takes a while."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True) as bar:
        bar.add_task(text, total=None)
        yield


def _json(value: Any) -> None:
    """Records and lists of records as JSON on stdout."""
    def plain(v: Any) -> Any:
        if isinstance(v, BaseModel):
            return v.to_dict() if hasattr(v, "to_dict") else v.model_dump(mode="json")
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    print(json.dumps(plain(value), indent=2))


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False)


def _print_lines(lines: Iterator[str]) -> None:
    for line in lines:
        sys.stdout.write(line)


# -- models -------------------------------------------------------------------------------------


@models_app.command("list")
def models_list(as_json: bool = JSON) -> None:
    """Imported models, and catalogue models not imported yet."""
    imported = sdk.list_models()
    if as_json:
        return _json(imported)
    rows: list[list[object]] = [[m.id, m.architecture, megabytes(m.size_bytes), m.content_hash[:12], m.source] for m in imported]
    have = {m.id for m in imported}
    rows += [[c.id, c.architecture, "", "", "catalogue (not imported)"] for c in sdk.catalog_models() if c.id not in have]
    terminal.listing(console, "Models", ["id", "architecture", "size", "hash", "source"], rows)


@models_app.command("show")
def models_show(model_id: str, as_json: bool = JSON) -> None:
    _json(sdk.get_model(model_id))


@models_app.command("import")
def models_import(
    spec: str = typer.Argument(..., help="Catalogue id, Hugging Face folder or .gguf file."),
    name: Optional[str] = typer.Option(None, help="Id to store it under."),
    chat_template: Optional[Path] = typer.Option(None, help="A Jinja chat template, for a model that has none."),
) -> None:
    """Import a model, checked (a GGUF's tokenizer rules and perplexity, the chat template)."""
    with _working(f"importing {spec}"):
        model = sdk.import_model(spec, name=name, chat_template=chat_template)
    console.print(f"imported [bold]{model.id}[/] ({megabytes(model.size_bytes)}, sha256 {model.content_hash[:12]}) at {model.path}; "
                  + ("" if model.perplexity is None else f"perplexity {model.perplexity} on held-out text; ")
                  + f"chat template: {model.chat_template or 'none'}")
    if model.chat_template is None:
        _warn([f"{model.id} has no chat template: chat requests will be refused with what to do; "
               "deploy it with --chat-template FILE, or import it again with one"])


@models_app.command("matrix")
def models_matrix(as_json: bool = JSON) -> None:
    """Which architectures go through which techniques here: from runs, with the date, or why not."""
    head, rows = sdk.coverage_matrix()
    if as_json:
        return _json([dict(zip(head, row)) for row in rows])
    terminal.listing(console, "Supported models, from runs (benchmarks/coverage.py)", head, rows)


@models_app.command("remove")
def models_remove(model_id: str) -> None:
    sdk.remove_model(model_id)
    console.print(f"removed {model_id}")


# -- deploy and endpoints -----------------------------------------------------------------------


@app.command()
def deploy(
    model: str = typer.Argument(..., help="Artifact folder or URI, model id, catalogue id, HF folder or .gguf file."),
    name: Optional[str] = typer.Option(None, help="Endpoint name (default: generated)."),
    port: Optional[int] = typer.Option(None, help="Port (default: a free one)."),
    host: str = typer.Option(sdk.DEFAULT_HOST, help="Address to bind."),
    timeout: float = typer.Option(sdk.DEFAULT_READY_TIMEOUT_S, help="Seconds to wait for readiness."),
    max_model_len: Optional[int] = typer.Option(None, help="Longest prompt plus output (models only)."),
    kv_cache_gib: Optional[int] = typer.Option(None, help="KV cache GiB on CPU (models only)."),
    api_key: Optional[str] = typer.Option(None, envvar="LLMOPT_API_KEY", show_envvar=True,
                                          help="Require this key (Bearer token) on every route."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without an API key."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run code the model's folder ships (never from a manifest)."),
    trust_compiled_code: bool = typer.Option(False, "--trust-compiled-code",
                                             help="Load the compiled code an artifact ships though no job of this home built it."),
    config: Optional[str] = typer.Option(None, help="A deployment configuration of the model (see `llmopt configs list`)."),
    chat_template: Optional[Path] = typer.Option(None, help="A Jinja chat template, for a model that has none."),
) -> None:
    """Start an endpoint and return once it is ready; it keeps serving after this command exits."""
    overrides = {k: v for k, v in {"max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib}.items() if v is not None}
    engine = sdk.engine_config(**overrides) if overrides else None
    doing = f"starting vLLM for {model}"
    if config is not None:
        chosen = next((c for c in sdk.configs(model) if c.name == config), None)
        _warn(sdk.config_warnings([chosen]) + sdk.config_verdicts([chosen])[0].warnings if chosen else [])
        doing = f"building (or reusing) and starting configuration {config} of {model}"
    with _working(doing):
        endpoint = sdk.deploy(model, name=name, port=port, host=host, engine=engine, timeout_s=timeout, api_key=api_key,
                              insecure=insecure, trust_remote_code=trust_remote_code, chat_template=chat_template, config=config,
                              trust_compiled_code=trust_compiled_code)
    console.print(f"endpoint [bold]{endpoint.name}[/] ready at {endpoint.url} in {endpoint.seconds_to_ready:.1f} s"
                  + (" (every route asks for the API key)" if endpoint.api_key else ""))
    if endpoint.start is not None:
        console.print(_start_line(endpoint.start))
        if endpoint.start.phases:
            console.print("start phases: " + ", ".join(f"{name} {s:.1f} s" for name, s in endpoint.start.phases.items()))
    console.print(f"stop it with: llmopt endpoints stop {endpoint.name}")


def _start_line(start: Any) -> str:
    key = start.key[:12]
    if start.outcome == "precompiled":
        return f"start: precompiled (compile cache {key}, no graph compiled); the cold start took {start.cold_ready_seconds:.1f} s"
    kept = f", {start.kernels_reused} C++ kernels copied from earlier compiles" if start.kernels_reused else ""
    return (f"start: {start.outcome} ({start.compiled_files_added} compiled files added to compile cache {key}{kept}; "
            "the next start reuses them)")


@endpoints_app.command("list")
def endpoints_list(status: Optional[str] = typer.Option(None, help="Only this status."), as_json: bool = JSON) -> None:
    found = sdk.list_endpoints(status)
    if as_json:
        return _json(found)
    rows = [[e.name, e.status, e.model, e.url, e.pid, when(e.started_at), f"{e.seconds_to_ready:.1f}" if e.ready_at else ""]
            for e in found]
    terminal.listing(console, "Endpoints", ["name", "status", "model", "url", "pid", "started", "ready (s)"], rows)


@endpoints_app.command("describe")
def endpoints_describe(name: str, as_json: bool = JSON) -> None:
    _json(sdk.get_endpoint(name))


@endpoints_app.command("logs")
def endpoints_logs(name: str, follow: bool = typer.Option(False, "--follow", "-f")) -> None:
    _print_lines(sdk.endpoint_logs(name, follow))


@endpoints_app.command("stop")
def endpoints_stop(name: str) -> None:
    endpoint = sdk.stop_endpoint(name)
    console.print(f"{endpoint.name}: {endpoint.status}")


# -- optimize and jobs --------------------------------------------------------------------------


@app.command()
def optimize(
    model: str = typer.Option(sdk.DEFAULT_MODEL, "--model", "-m", help="Model id, catalogue id, HF folder or .gguf."),
    recipe: str = typer.Option("baseline", "--recipe", "-r", help="Built-in recipe name or YAML/JSON file."),
    quantize: Optional[str] = typer.Option(None, help="awq | smoothquant | fp8"),
    kv_cache: Optional[str] = typer.Option(None, help="KV cache dtype: fp8 | fp8_e5m2"),
    speculative: Optional[str] = typer.Option(None, help="ngram | draft | draft=ID_OR_PATH"),
    compile: bool = typer.Option(False, "--compile", help="Ahead-of-time compile for the recipe's shapes."),
    tensor_parallel: Optional[int] = typer.Option(None, help="Tensor-parallel degree."),
    name: Optional[str] = typer.Option(None, help="Job name (default: generated)."),
    output: Optional[str] = typer.Option(None, help="Artifact folder (default: under the llmopt home), or an fsspec URI the cluster reads (file://, s3://...)."),
    force: bool = typer.Option(False, help="Rebuild even if an artifact with the same key exists."),
    wait: bool = typer.Option(False, "--wait", help="Follow the job and exit non-zero unless it completes."),
    executor: str = typer.Option("local", help=f"Where the job's worker runs: {' | '.join(sdk.JOB_EXECUTORS)} (a background process here, or a Ray job)."),
    ray_address: Optional[str] = typer.Option(None, help="The Ray dashboard's address for --executor ray (default http://127.0.0.1:8265)."),
) -> None:
    """Run a recipe on a model in a background job that writes an optimized artifact."""
    chosen = sdk.recipe_from_flags(sdk.load_recipe(recipe), quantize, kv_cache, speculative, compile, tensor_parallel)
    job = sdk.optimize(model, chosen, name=name, output=output, force=force, wait=False,
                       executor=executor, ray_address=ray_address)
    _warn(job.warnings)
    if job.reused_from:
        console.print(f"job [bold]{job.name}[/] reuses the artifact of job {job.reused_from} (same key; --force rebuilds)")
    else:
        console.print(f"job [bold]{job.name}[/] started; follow it with: llmopt jobs wait {job.name}")
    if wait:
        _follow_job(job.name)


def _follow_job(name: str) -> None:
    """Progress bars per step until the job ends; exit 1 unless it completed."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=err) as bar:
        tasks: dict[str, Any] = {}
        while True:
            record = sdk.get_job(name)
            for step, state in record.progress.items():
                if step not in tasks:
                    tasks[step] = bar.add_task(step, total=1.0)
                bar.update(tasks[step], completed=state.fraction)
            if record.status not in sdk.ACTIVE_JOB_STATUSES:
                break
            time.sleep(0.5)
    if record.status != "COMPLETED":
        raise sdk.LlmoptError(f"job {name} ended {record.status}: {record.failure_reason or 'stopped'}", f"see `llmopt jobs logs {name}`")
    console.print(f"job [bold]{name}[/] COMPLETED: artifact at {record.artifact}")


@jobs_app.command("list")
def jobs_list(
    status: Optional[str] = typer.Option(None, help="Only this status."),
    name_contains: Optional[str] = typer.Option(None, help="Only names containing this."),
    as_json: bool = JSON,
) -> None:
    found = sdk.list_jobs(status, name_contains)
    if as_json:
        return _json(found)
    rows = [[j.name, j.status, j.source, j.recipe.get("name", "custom"), when(j.created_at),
             f"{j.ended_at - j.started_at:.1f}" if j.ended_at and j.started_at else "", j.failure_reason or j.artifact or ""]
            for j in found]
    terminal.listing(console, "Jobs", ["name", "status", "source", "recipe", "created", "seconds", "artifact / reason"], rows)


@jobs_app.command("describe")
def jobs_describe(name: str, as_json: bool = JSON) -> None:
    _json(sdk.get_job(name))


@jobs_app.command("logs")
def jobs_logs(name: str, follow: bool = typer.Option(False, "--follow", "-f")) -> None:
    _print_lines(sdk.job_logs(name, follow))


@jobs_app.command("stop")
def jobs_stop(name: str) -> None:
    console.print(f"{name}: {sdk.stop_job(name).status}")


@jobs_app.command("wait")
def jobs_wait(name: str) -> None:
    """Follow a job until it ends; exit non-zero unless it completed."""
    _follow_job(name)


@app.command("export-command")
def export_command(
    artifact_dir: Path = typer.Argument(..., help="Artifact folder."),
    port: int = typer.Option(8000, help="Port in the command."),
    host: str = typer.Option(sdk.DEFAULT_HOST, help="Address in the command."),
) -> None:
    """Print the plain vLLM command that serves an artifact without llmopt."""
    print(sdk.export_command(str(artifact_dir), host=host, port=port))


@app.command("export")
def export(
    artifact_dir: Path = typer.Argument(..., help="Artifact folder."),
    fmt: str = typer.Option(..., "--format", help=f"One of {', '.join(sdk.EXPORT_FORMATS)}."),
    output: Path = typer.Option(..., "--output", "-o", help="Folder to write into (made if missing)."),
    replicas: int = typer.Option(1, min=1, help="Replicas to run."),
    cpus: Optional[float] = typer.Option(None, help="CPUs per replica (default: from the manifest)."),
    memory_gib: Optional[float] = typer.Option(None, help="Memory per replica in GiB (default: from the model size)."),
    gpus: int = typer.Option(0, min=0, help="GPUs per replica; 0 serves on CPUs."),
    image: Optional[str] = typer.Option(None, help="Container image (default: vLLM's for the artifact's engine version)."),
    model_uri: Optional[str] = typer.Option(None, help="Where the cluster fetches the artifact (s3://, gs://, pvc://, file://)."),
) -> None:
    """Write an artifact's deployment for Ray Serve, KServe, Kubernetes or Docker Compose."""
    for path in sdk.export_deployment(artifact_dir, fmt, output, replicas, cpus, memory_gib, gpus, image, model_uri):  # type: ignore[arg-type]
        print(path)


# -- recipes ------------------------------------------------------------------------------------


@recipes_app.command("list")
def recipes_list(as_json: bool = JSON) -> None:
    found = sdk.list_recipes()
    if as_json:
        return _json({name: r.to_dict() for name, r in found.items()})
    rows = [[name, ", ".join(r.techniques()) or "(none: package as is)"] for name, r in found.items()]
    terminal.listing(console, "Built-in recipes", ["name", "techniques"], rows)


@recipes_app.command("show")
def recipes_show(recipe: str) -> None:
    """A recipe (built-in name or file) in full, with every default filled in, as YAML."""
    print(sdk.load_recipe(recipe).to_yaml(), end="")


@recipes_app.command("schema")
def recipes_schema() -> None:
    """The JSON schema of recipes: every section and knob."""
    print(json.dumps(sdk.recipe_schema(), indent=2))


@recipes_app.command("matrix")
def recipes_matrix(as_json: bool = JSON) -> None:
    """The compatibility matrix: technique x architecture x engine x hardware."""
    rows = sdk.compatibility_matrix()
    if as_json:
        return _json(list(rows))
    terminal.listing(console, "Compatibility", ["technique", "hardware", "architectures", "processors", "status", "reason"], [
        [r.technique, r.hardware, ", ".join(r.architectures) if isinstance(r.architectures, list) else r.architectures,
         ", ".join(r.processors or []) or "any", r.status, r.reason] for r in rows])


# -- compile cache ------------------------------------------------------------------------------


@cache_app.command("list")
def cache_list(as_json: bool = JSON) -> None:
    """Every entry: its key, what it was compiled for, its size, and when it was last used."""
    found = sdk.list_cache()
    if as_json:
        return _json(found)
    rows = [[e.key[:16], e.weights[:12], f"len {e.max_model_len}, seqs {e.max_num_seqs or 'default'}", e.engine,
             f"{e.size_bytes / 1e6:.1f}", f"{e.cold_ready_seconds:.1f}" if e.cold_ready_seconds else "", when(e.last_used)]
            for e in found]
    terminal.listing(console, "Compile cache", ["key", "weights layout", "shapes", "engine", "MB", "cold start (s)", "last used"], rows)
    for kept in sdk.kept_kernels():
        console.print(f"kept C++ kernels for torch {kept.torch}: {kept.libraries} libraries, {kept.size_bytes / 1e6:.1f} MB, "
                      "shared by its entries")


@cache_app.command("prune")
def cache_prune(
    all_entries: bool = typer.Option(False, "--all", help="Remove every entry not in use."),
    older_than_days: float = typer.Option(30.0, help="Remove entries unused for this many days."),
) -> None:
    """Remove entries that have not been used for a while (never one a live endpoint started from)."""
    removed = sdk.prune_cache(None if all_entries else older_than_days)
    for entry in removed:
        console.print(f"removed {entry.key[:16]} ({entry.size_bytes / 1e6:.1f} MB)")
    console.print(f"{len(removed)} entries removed, {sum(e.size_bytes for e in removed) / 1e6:.1f} MB freed")


# -- configurations and recommendations ---------------------------------------------------------


@configs_app.command("list")
def configs_list(model: str = typer.Argument(sdk.DEFAULT_MODEL, help="Model id or catalogue id."), as_json: bool = JSON) -> None:
    """A model's deployment configurations and their benchmark rows: measured here first, then shipped."""
    found = sdk.configs(model)
    if as_json:  # with what holds for each here, as the studio has them
        return _json(sdk.config_listing(found))
    recommendation.configurations(found, console)
    _warn(sdk.config_warnings(found))
    verdicts = list(zip(found, sdk.config_verdicts(found)))
    for said, how in (("refusals", "cannot run on this machine, and `deploy --config` refuses them here"),
                      ("warnings", "run slowly on this machine")):
        by_reason: dict[str, dict[str, None]] = {}  # each reason's configurations, named once, in order
        for config, said_here in verdicts:
            for reason in getattr(said_here, said)[:1]:
                by_reason.setdefault(reason, {})[config.name] = None
        _warn([f"{', '.join(named)} {how}: {reason}" for reason, named in by_reason.items()])
    if not found:
        console.print(f"none yet; measure some with: llmopt recommend {model}")


@app.command()
def recommend(
    model: str = typer.Argument(sdk.DEFAULT_MODEL, help="Model id, catalogue id, HF folder or .gguf."),
    goal: str = typer.Option("balanced", help="latency | throughput | cost | balanced"),
    slo: Optional[list[str]] = typer.Option(None, help="A service-level target, e.g. ttft_p90_ms=800 (repeat the flag)."),
    max_quality_loss: Optional[float] = typer.Option(None, help="Largest perplexity increase allowed, as a fraction."),
    dataset: str = typer.Option("builtin-qa", help="builtin-qa | builtin-coding | sharegpt | synthetic:IN,OUT | PATH.jsonl"),
    concurrency: str = typer.Option("1,2,4,8", help="Comma-separated concurrency levels."),
    requests: int = typer.Option(8, help="Requests per level, the same prompts at every level (at least 4 per user of the highest)."),
    min_duration: float = typer.Option(10.0, help="Seconds each level runs at least."),
    budget_minutes: Optional[float] = typer.Option(None, help="Drop the most expensive candidates to fit this budget."),
    recipe: Optional[list[str]] = typer.Option(None, help="A recipe file of yours to try too (repeat the flag)."),
    output: Path = typer.Option(Path("llmopt-recommend"), help="Folder for recommendation.json and report.html."),
    executor: str = typer.Option("local", help=f"Where candidates' jobs run: {' | '.join(sdk.JOB_EXECUTORS)} (ray: all built at once, then measured here)."),
    ray_address: Optional[str] = typer.Option(None, help="The Ray dashboard's address for --executor ray (default http://127.0.0.1:8265)."),
) -> None:
    """Measure the candidates the matrix allows for a model on this machine and recommend one for the goal."""
    with _recommend_progress() as events:
        rec = sdk.recommend(model, goal=goal, slos=slo or [], max_quality_loss=max_quality_loss, dataset=dataset,
                            concurrency=_levels(concurrency), requests=requests, min_duration_s=min_duration,
                            budget_minutes=budget_minutes, recipes=recipe or [], output=output, events=events,
                            executor=executor, ray_address=ray_address)
    recommendation.table(rec, console)
    console.print(f"results: {output / recommendation.RESULTS_FILE}  report: {output / recommendation.REPORT_FILE}")


@contextmanager
def _recommend_progress() -> Iterator[Callable[..., None]]:
    """The estimates first, then a line per candidate and a bar per level."""
    with _evaluation_progress() as level_events:
        def events(kind: str, **data: Any) -> None:
            if kind == "estimates":
                recommendation.estimates(data["recommendation"], console)
            elif kind == "candidate":
                err.print(f"candidate [bold]{data['name']}[/] (about {data['estimate_s'] / 60:.1f} min)")
            elif kind == "building":
                err.print(f"building every candidate's job first, on {data['executor']}: {', '.join(data['jobs'])}")
            else:
                level_events(kind, **data)

        yield events


# -- evaluate -----------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise sdk.LlmoptError(f"bad --concurrency '{text}'", "give comma-separated integers, e.g. 1,2,4") from None


@contextmanager
def _evaluation_progress() -> Iterator[Callable[..., None]]:
    """Progress bars for an evaluation: a spinner per deploy, a bar per concurrency level."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        current: dict[str, Any] = {}

        def events(kind: str, **data: Any) -> None:
            if kind == "deploying":
                current["task"] = bar.add_task(f"deploying {data['target']}", total=None)
            elif kind == "level":
                current["task"] = bar.add_task(f"{data['target']} @ concurrency {data['concurrency']}", total=data["total"])
            elif kind == "request" and "task" in current:
                bar.advance(current["task"])
            elif kind == "quality":
                current["task"] = bar.add_task(f"{data['target']}: quality", total=None)

        yield events


@app.command()
def evaluate(
    endpoint: Optional[str] = typer.Option(None, help="Name of a running llmopt endpoint."),
    url: Optional[str] = typer.Option(None, help="Any OpenAI-compatible server URL."),
    model: Optional[str] = typer.Option(None, help="A model or artifact, deployed for the run."),
    compare: Optional[list[str]] = typer.Option(None, help="Models/artifacts to compare, deployed in turn (repeat the flag)."),
    dataset: str = typer.Option("builtin-qa", help="builtin-qa | sharegpt | synthetic:IN,OUT | PATH.jsonl"),
    concurrency: str = typer.Option("1,4", help="Comma-separated concurrency levels."),
    requests: int = typer.Option(16, help="Requests per level after warm-up, the same prompts at every level (at least 4 per user of the highest)."),
    duration: Optional[float] = typer.Option(None, help="Seconds per level instead of a request count."),
    min_duration: float = typer.Option(30.0, help="With a request count, seconds each level runs at least."),
    output: Path = typer.Option(Path("llmopt-eval"), help="Folder for results.json and report.html."),
    hardware: Optional[str] = typer.Option(None, help="Hardware profile whose hourly price is used."),
    price_per_hour: Optional[float] = typer.Option(None, help="Hourly price, overriding the profile."),
    discount: Optional[float] = typer.Option(None, help="Discount on the hourly price, 0-1."),
    hardware_file: Optional[Path] = typer.Option(None, help="YAML file of hardware profiles."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer folder (for --url targets)."),
    ttft_target: Optional[float] = typer.Option(None, help="Goodput target for TTFT, ms."),
    itl_target: Optional[float] = typer.Option(None, help="Goodput target for time per output token, ms."),
    timeout: float = typer.Option(300.0, help="Per-request timeout, seconds."),
    quality: bool = typer.Option(True, help="Also measure perplexity and greedy outputs."),
    seed: int = typer.Option(0, help="Workload sampling seed."),
    api_key: Optional[str] = typer.Option(None, envvar="LLMOPT_API_KEY", show_envvar=True,
                                          help="Key for a --url server that asks for one."),
    name: Optional[str] = typer.Option(None, help="Name of the evaluation's record (default: generated)."),
    background: bool = typer.Option(False, "--background", help="Run in a worker process; follow it with `llmopt evaluations`."),
    executor: str = typer.Option("local", help=f"Where a background run's worker runs: {' | '.join(sdk.JOB_EXECUTORS)} (ray implies --background)."),
    ray_address: Optional[str] = typer.Option(None, help="The Ray dashboard's address for --executor ray (default http://127.0.0.1:8265)."),
) -> None:
    """Load-test at several concurrency levels and report latency, throughput, price and quality."""
    if background or executor != "local":
        record = sdk.evaluate(endpoint=endpoint, url=url, model=model, compare=compare, dataset=dataset,
                              concurrency=_levels(concurrency), requests=requests, duration_s=duration,
                              min_duration_s=min_duration, hardware=hardware, price_per_hour=price_per_hour,
                              discount=discount, hardware_file=hardware_file, quality=quality, tokenizer=tokenizer,
                              ttft_target_ms=ttft_target, itl_target_ms=itl_target, timeout_s=timeout, seed=seed,
                              api_key=api_key, name=name, background=True, executor=executor, ray_address=ray_address)
        console.print(f"evaluation [bold]{record.name}[/] started; follow it with: llmopt evaluations describe {record.name}")
        return
    with _evaluation_progress() as events:
        results = sdk.evaluate(endpoint=endpoint, url=url, model=model, compare=compare, dataset=dataset,
                               concurrency=_levels(concurrency), requests=requests, duration_s=duration,
                               min_duration_s=min_duration, output=output,
                               hardware=hardware, price_per_hour=price_per_hour, discount=discount,
                               hardware_file=hardware_file, quality=quality, tokenizer=tokenizer,
                               ttft_target_ms=ttft_target, itl_target_ms=itl_target, timeout_s=timeout, seed=seed,
                               events=events, api_key=api_key, name=name)
    terminal.evaluation(results, console)
    skipped = results.workload.skipped_lines if results.workload else None
    if skipped:
        err.print(f"[yellow]warning:[/] skipped {skipped.count} malformed dataset lines: {skipped.line_numbers[:20]}")
    console.print(f"results: {output / RESULTS_FILE}  report: {output / REPORT_FILE}")
    aborted = [t.aborted for t in results.targets if t.aborted]
    if aborted:
        raise sdk.LlmoptError(f"run ended early: {aborted[0]}", f"partial results were saved in {output}")


@evaluations_app.command("list")
def evaluations_list(status: Optional[str] = typer.Option(None, help="Only this status."), as_json: bool = JSON) -> None:
    found = sdk.list_evaluations(status)
    if as_json:
        return _json(found)
    rows = [[e.name, e.status, ", ".join(spec for spec, _ in e.arguments["targets"]), e.arguments["plan"]["dataset"],
             when(e.created_at), e.progress.stage, e.failure_reason or e.output_dir] for e in found]
    terminal.listing(console, "Evaluations", ["name", "status", "targets", "dataset", "created", "progress", "results / reason"], rows)


@evaluations_app.command("describe")
def evaluations_describe(name: str, as_json: bool = JSON) -> None:
    _json(sdk.get_evaluation(name))


@evaluations_app.command("logs")
def evaluations_logs(name: str, follow: bool = typer.Option(False, "--follow", "-f")) -> None:
    _print_lines(sdk.evaluation_logs(name, follow))


@evaluations_app.command("stop")
def evaluations_stop(name: str) -> None:
    console.print(f"{name}: {sdk.stop_evaluation(name).status}")


# -- studio -------------------------------------------------------------------------------------


@app.command()
def studio(
    host: str = typer.Option("127.0.0.1", help="Address to bind (another needs --insecure or --token)."),
    port: int = typer.Option(8765, help="Port."),
    token: Optional[str] = typer.Option(None, envvar="LLMOPT_STUDIO_TOKEN", help="The access token (default: generated)."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback host without a token of your own."),
) -> None:
    """The web studio: the SDK in a browser (offline, token-protected). Prints the URL to open."""
    from llmopt.studio import app as studio_app

    studio_app.serve(host=host, port=port, token=token, insecure=insecure)


# -- demo ---------------------------------------------------------------------------------------


@app.command()
def demo(
    model: str = typer.Option(sdk.DEFAULT_MODEL, help="Model to optimize."),
    recipe: str = typer.Option("auto", "--recipe", "-r",
                               help="'auto' (what pays on this processor), a built-in recipe name or a YAML/JSON file."),
    concurrency: str = typer.Option("1,4", help="Comma-separated concurrency levels to compare at (and sweep speculation at)."),
    requests: int = typer.Option(8, help="Requests per level, the same prompts at every level (at least 4 per user of the highest)."),
    min_duration: float = typer.Option(30.0, help="Seconds each level runs at least."),
    dataset: str = typer.Option("builtin-qa", help="The side-by-side load test's requests: builtin-qa, builtin-coding, "
                                                   "sharegpt, synthetic:IN,OUT or your JSONL."),
    output: Path = typer.Option(Path("llmopt-demo"), help="Folder for results.json and report.html."),
) -> None:
    """The main job: optimize a model with what pays on this processor, then load-test it side by side
    with the original, throughput on equal work, and say what it bought and what it cost."""
    levels = tuple(_levels(concurrency))
    # refused before the job, not after
    sdk.evaluation_plan(concurrency=levels, requests=requests, min_duration_s=min_duration, dataset=dataset)
    with _working(f"importing {model} (once)"):
        imported = sdk.resolve_model(model)
    console.print(f"model [bold]{imported.id}[/] at {imported.path} (sha256 {imported.content_hash[:12]})")
    chosen = sdk.demo_recipe(imported.id, levels) if recipe == "auto" else sdk.load_recipe(recipe)
    console.print(f"recipe [bold]{chosen.name or 'custom'}[/]: {', '.join(chosen.techniques()) or 'none'}")
    job = sdk.optimize(imported.id, chosen, wait=False)
    _warn(job.warnings)
    if job.reused_from:
        console.print(f"job [bold]{job.name}[/] reuses the artifact of job {job.reused_from}")
    _follow_job(job.name)
    with _evaluation_progress() as events:
        results = sdk.evaluate(compare=[imported.id, str(job.artifact)], dataset=dataset, concurrency=levels,
                               requests=requests, min_duration_s=min_duration, output=output, events=events)
    terminal.evaluation(results, console)
    console.print(verdict(results))
    console.print(f"results: {output / RESULTS_FILE}  report: {output / REPORT_FILE}")


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds like an interrupt: half-made imports and deployed targets are cleaned up


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 1; an interrupt exits 130."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = app(standalone_mode=False)
    except sdk.LlmoptError as exc:
        err.print(f"[red]error:[/] {escape(exc.one_line())}", highlight=False, soft_wrap=True)  # "llmopt[ray]" is no markup
        sys.exit(1)
    except KeyboardInterrupt:
        code = 130
    except click.ClickException as exc:  # usage errors
        exc.show()
        sys.exit(exc.exit_code)
    if code == 130:
        err.print("interrupted; anything running in the background (a job, an endpoint) goes on")
    sys.exit(code if isinstance(code, int) else 0)

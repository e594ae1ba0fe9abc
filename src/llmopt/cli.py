"""The `llmopt` command: typer commands over the SDK, nothing more."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmopt import catalog, compatibility, endpoints, paths, sdk, sources
from llmopt import recipe as recipes
from llmopt.jobs import runner, store
from llmopt.engine import compile_cache
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Optimize, evaluate and deploy LLMs on vLLM.")
models_app = typer.Typer(no_args_is_help=True, help="The model store.")
endpoints_app = typer.Typer(no_args_is_help=True, help="Running endpoints.")
jobs_app = typer.Typer(no_args_is_help=True, help="Optimization jobs.")
recipes_app = typer.Typer(no_args_is_help=True, help="Recipes and the compatibility matrix.")
cache_app = typer.Typer(no_args_is_help=True, help="The compile cache: compiled engine code, one entry per key.")
app.add_typer(models_app, name="models")
app.add_typer(endpoints_app, name="endpoints")
app.add_typer(jobs_app, name="jobs")
app.add_typer(recipes_app, name="recipes")
app.add_typer(cache_app, name="cache")

console = Console()
err = Console(stderr=True)


@app.callback()
def _root(
    home: Optional[Path] = typer.Option(None, "--home", envvar=paths.HOME_ENV, help="llmopt's state folder (models, records, logs)."),
) -> None:
    if home is not None:
        os.environ[paths.HOME_ENV] = str(home.expanduser().resolve())


@contextmanager
def _working(text: str) -> Iterator[None]:
    """A spinner with elapsed time for anything that takes a while."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True) as bar:
        bar.add_task(text, total=None)
        yield


def _table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else ""


# -- models -------------------------------------------------------------------------------------


@models_app.command("list")
def models_list() -> None:
    """Imported models, and catalogue models not imported yet."""
    imported = sources.list_models()
    rows: list[list[object]] = [[m.id, m.architecture, f"{m.size_bytes / 1e6:.0f} MB", m.content_hash[:12], m.source] for m in imported]
    have = {m.id for m in imported}
    rows += [[i, catalog.get(i).architecture, "", "", "catalogue (not imported)"] for i in catalog.ids() if i not in have]
    _table("Models", ["id", "architecture", "size", "hash", "source"], rows)


@models_app.command("show")
def models_show(model_id: str) -> None:
    model = sources.get(model_id)
    if model is None:
        raise LlmoptError(f"no imported model named '{model_id}'", "see `llmopt models list`")
    console.print_json(json.dumps(model.to_dict()))


@models_app.command("import")
def models_import(
    spec: str = typer.Argument(..., help="Catalogue id, Hugging Face folder or .gguf file."),
    name: Optional[str] = typer.Option(None, help="Id to store it under."),
) -> None:
    with _working(f"importing {spec}"):
        model = sdk.import_model(spec, name=name)
    console.print(f"imported [bold]{model.id}[/] ({model.size_bytes / 1e6:.0f} MB, sha256 {model.content_hash[:12]}) at {model.path}")


@models_app.command("remove")
def models_remove(model_id: str) -> None:
    sources.remove(model_id)
    console.print(f"removed {model_id}")


# -- deploy and endpoints -----------------------------------------------------------------------


@app.command()
def deploy(
    model: str = typer.Argument(..., help="Artifact folder, model id, catalogue id, HF folder or .gguf file."),
    name: Optional[str] = typer.Option(None, help="Endpoint name (default: generated)."),
    port: Optional[int] = typer.Option(None, help="Port (default: a free one)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    timeout: float = typer.Option(endpoints.DEFAULT_READY_TIMEOUT_S, help="Seconds to wait for readiness."),
    max_model_len: Optional[int] = typer.Option(None, help="Longest prompt plus output (models only)."),
    kv_cache_gib: Optional[int] = typer.Option(None, help="KV cache GiB on CPU (models only)."),
) -> None:
    """Start an endpoint and return once it is ready; it keeps serving after this command exits."""
    overrides = {k: v for k, v in {"max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib}.items() if v is not None}
    engine = EngineConfig(**overrides) if overrides else None
    with _working(f"starting vLLM for {model}"):
        endpoint = sdk.deploy(model, name=name, port=port, host=host, engine=engine, timeout_s=timeout)
    console.print(f"endpoint [bold]{endpoint.name}[/] ready at {endpoint.url} in {endpoint.seconds_to_ready:.1f} s")
    console.print(_compile_cache_line(endpoint.to_dict()["verification"]["compile_cache"]))
    console.print(f"stop it with: llmopt endpoints stop {endpoint.name}")


def _compile_cache_line(cache: dict) -> str:
    key = cache["key"][:12]
    if cache["outcome"] == "precompiled":
        return f"start: precompiled (compile cache {key}, no graph compiled); the cold start took {cache['cold_ready_seconds']:.1f} s"
    return f"start: {cache['outcome']} ({cache['compiled_files_added']} compiled files added to compile cache {key}; the next start reuses them)"


@endpoints_app.command("list")
def endpoints_list(status: Optional[str] = typer.Option(None, help="Only this status.")) -> None:
    rows = [
        [e.name, e.status, e.model, e.url, e.pid, _when(e.started_at), f"{e.seconds_to_ready:.1f}" if e.ready_at else ""]
        for e in endpoints.list_endpoints(status)
    ]
    _table("Endpoints", ["name", "status", "model", "url", "pid", "started", "ready (s)"], rows)


@endpoints_app.command("describe")
def endpoints_describe(name: str) -> None:
    console.print_json(json.dumps(endpoints.get(name).to_dict()))


@endpoints_app.command("logs")
def endpoints_logs(name: str, follow: bool = typer.Option(False, "--follow", "-f")) -> None:
    _print_log(Path(endpoints.get(name).log_path), follow, lambda: endpoints.get(name).status in endpoints.LIVE)


def _print_log(path: Path, follow: bool, alive) -> None:
    """A log file, or with --follow its lines as they are written until the process ends."""
    if not path.exists():
        return
    if not follow:
        sys.stdout.write(path.read_text(errors="replace"))
        return
    for line in endpoints.follow(path, alive):
        sys.stdout.write(line)


@endpoints_app.command("stop")
def endpoints_stop(name: str) -> None:
    endpoint = endpoints.stop(name)
    console.print(f"{endpoint.name}: {endpoint.status}")


# -- optimize and jobs --------------------------------------------------------------------------


@app.command()
def optimize(
    model: str = typer.Option(catalog.DEFAULT_MODEL, "--model", "-m", help="Model id, catalogue id, HF folder or .gguf."),
    recipe: str = typer.Option("baseline", "--recipe", "-r", help="Built-in recipe name or YAML/JSON file."),
    quantize: Optional[str] = typer.Option(None, help="awq | smoothquant | fp8"),
    kv_cache: Optional[str] = typer.Option(None, help="KV cache dtype: fp8 | fp8_e5m2"),
    speculative: Optional[str] = typer.Option(None, help="ngram | draft | draft=ID_OR_PATH"),
    compile: bool = typer.Option(False, "--compile", help="Ahead-of-time compile for the recipe's shapes."),
    tensor_parallel: Optional[int] = typer.Option(None, help="Tensor-parallel degree."),
    name: Optional[str] = typer.Option(None, help="Job name (default: generated)."),
    output: Optional[Path] = typer.Option(None, help="Artifact folder (default: under the llmopt home)."),
    force: bool = typer.Option(False, help="Rebuild even if an artifact with the same key exists."),
    wait: bool = typer.Option(False, "--wait", help="Follow the job and exit non-zero unless it completes."),
) -> None:
    """Run a recipe on a model in a background job that writes an optimized artifact."""
    chosen = recipes.load(recipe)
    flags = recipes.flag_overrides(quantize, kv_cache, speculative, compile, tensor_parallel)
    if flags:
        chosen = chosen.merged(flags)
    job = sdk.optimize(model, chosen, name=name, output=str(output) if output else None, force=force, wait=False)
    for warning in job.warnings:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False)
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
        tasks: dict[str, int] = {}
        while True:
            record = store.get(name)
            for step, state in record.steps.items():
                if step not in tasks:
                    tasks[step] = bar.add_task(step, total=1.0)
                bar.update(tasks[step], completed=state.get("fraction", 0.0))
            if record.status not in store.ACTIVE:
                break
            time.sleep(0.5)
    if record.status != store.COMPLETED:
        raise LlmoptError(f"job {name} ended {record.status}: {record.failure_reason or 'stopped'}", f"see `llmopt jobs logs {name}`")
    console.print(f"job [bold]{name}[/] COMPLETED: artifact at {record.artifact}")


@jobs_app.command("list")
def jobs_list(
    status: Optional[str] = typer.Option(None, help="Only this status."),
    name_contains: Optional[str] = typer.Option(None, help="Only names containing this."),
) -> None:
    rows = [
        [j.name, j.status, j.source, json.loads(j.recipe).get("name", "custom"), _when(j.created_at),
         f"{j.ended_at - j.started_at:.1f}" if j.ended_at and j.started_at else "", j.failure_reason or j.artifact or ""]
        for j in store.list_jobs(status, name_contains)
    ]
    _table("Jobs", ["name", "status", "source", "recipe", "created", "seconds", "artifact / reason"], rows)


@jobs_app.command("describe")
def jobs_describe(name: str) -> None:
    console.print_json(json.dumps(store.get(name).to_dict()))


@jobs_app.command("logs")
def jobs_logs(name: str, follow: bool = typer.Option(False, "--follow", "-f")) -> None:
    _print_log(Path(store.get(name).log_path), follow, lambda: store.get(name).status in store.ACTIVE)


@jobs_app.command("stop")
def jobs_stop(name: str) -> None:
    console.print(f"{name}: {runner.stop(name).status}")


@jobs_app.command("wait")
def jobs_wait(name: str) -> None:
    """Follow a job until it ends; exit non-zero unless it completed."""
    _follow_job(name)


@app.command("export-command")
def export_command(
    artifact_dir: Path = typer.Argument(..., help="Artifact folder."),
    port: int = typer.Option(8000, help="Port in the command."),
    host: str = typer.Option("127.0.0.1", help="Address in the command."),
) -> None:
    """Print the plain vLLM command that serves an artifact without llmopt."""
    print(sdk.export_command(str(artifact_dir), host=host, port=port))


@recipes_app.command("list")
def recipes_list() -> None:
    rows = [[name, ", ".join(recipes.parse(data).techniques()) or "(none: package as is)"] for name, data in recipes.BUILTIN.items()]
    _table("Built-in recipes", ["name", "techniques"], rows)


@recipes_app.command("show")
def recipes_show(recipe: str) -> None:
    """A recipe (built-in name or file) in full, with every default filled in, as YAML."""
    print(recipes.load(recipe).to_yaml(), end="")


@recipes_app.command("schema")
def recipes_schema() -> None:
    """The JSON schema of recipes: every section and knob."""
    print(json.dumps(recipes.Recipe.model_json_schema(), indent=2))


@recipes_app.command("matrix")
def recipes_matrix() -> None:
    """The compatibility matrix: technique x architecture x engine x hardware."""
    rows = [[r["technique"], r["hardware"], ", ".join(r["architectures"]) if isinstance(r["architectures"], list) else r["architectures"],
             r["status"], r.get("reason", "")] for r in compatibility.matrix()]
    _table("Compatibility", ["technique", "hardware", "architectures", "status", "reason"], rows)


# -- compile cache ------------------------------------------------------------------------------


@cache_app.command("list")
def cache_list() -> None:
    """Every entry: its key, what it was compiled for, its size, and when it was last used."""
    rows = []
    for entry in compile_cache.list_entries():
        parts, meta = entry.components, entry.meta
        args = parts["engine_args"]
        shapes = f"len {args.get('max-model-len')}, seqs {args.get('max-num-seqs', 'default')}"
        cold = meta.get("cold_ready_seconds")
        rows.append([entry.key[:16], parts["weights"][:12], shapes, " ".join(parts["engine"]), f"{entry.size_bytes() / 1e6:.1f}",
                     f"{cold:.1f}" if cold else "", _when((entry.path / compile_cache.KEY_FILE).stat().st_mtime)])
    _table("Compile cache", ["key", "weights", "shapes", "engine", "MB", "cold start (s)", "last used"], rows)


@cache_app.command("prune")
def cache_prune(
    all_entries: bool = typer.Option(False, "--all", help="Remove every entry not in use."),
    older_than_days: float = typer.Option(30.0, help="Remove entries unused for this many days."),
) -> None:
    """Remove entries that have not been used for a while (never one a live endpoint started from)."""
    removed = compile_cache.prune(None if all_entries else older_than_days * 86400, keep=endpoints.compile_cache_keys_in_use())
    for entry, size in removed:
        console.print(f"removed {entry.key[:16]} ({size / 1e6:.1f} MB)")
    console.print(f"{len(removed)} entries removed, {sum(s for _, s in removed) / 1e6:.1f} MB freed")


# -- evaluate -----------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LlmoptError(f"bad --concurrency '{text}'", "give comma-separated integers, e.g. 1,2,4") from None


@contextmanager
def _evaluation_progress() -> Iterator[Callable[..., None]]:
    """Progress bars for an evaluation: a spinner per deploy, a bar per concurrency level."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        current: dict[str, int] = {}

        def events(kind: str, **data) -> None:
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
    requests: int = typer.Option(16, help="Requests per level (after warm-up)."),
    duration: Optional[float] = typer.Option(None, help="Seconds per level instead of a request count."),
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
) -> None:
    """Load-test at several concurrency levels and report latency, throughput, price and quality."""
    from llmopt.evaluation import report

    with _evaluation_progress() as events:
        results = sdk.evaluate(endpoint=endpoint, url=url, model=model, compare=compare, dataset=dataset,
                               concurrency=_levels(concurrency), requests=requests, duration_s=duration, output=output,
                               hardware=hardware, price_per_hour=price_per_hour, discount=discount,
                               hardware_file=hardware_file, quality=quality, tokenizer=tokenizer,
                               ttft_target_ms=ttft_target, itl_target_ms=itl_target, timeout_s=timeout, seed=seed,
                               events=events)
    report.table(results, console)
    skipped = (results.get("workload") or {}).get("skipped_lines")
    if skipped:
        err.print(f"[yellow]warning:[/] skipped {skipped['count']} malformed dataset lines: {skipped['line_numbers'][:20]}")
    console.print(f"results: {output / report.RESULTS_FILE}  report: {output / report.REPORT_FILE}")
    aborted = [t["aborted"] for t in results["targets"] if t.get("aborted")]
    if aborted:
        raise LlmoptError(f"run ended early: {aborted[0]}", f"partial results were saved in {output}")


# -- demo ---------------------------------------------------------------------------------------


@app.command()
def demo(
    model: str = typer.Option(catalog.DEFAULT_MODEL, help="Model to optimize."),
    recipe: str = typer.Option("smoothquant", "--recipe", "-r", help="Built-in recipe name or YAML/JSON file."),
    requests: int = typer.Option(8, help="Requests per concurrency level."),
    output: Path = typer.Option(Path("llmopt-demo"), help="Folder for results.json and report.html."),
) -> None:
    """The main job: optimize a model with a recipe, then load-test it side by side with the original."""
    from llmopt import demo as demo_module
    from llmopt.evaluation import report

    chosen = recipes.load(recipe)
    with _working(f"importing {model} (once)"):
        imported = sources.resolve(model)
    console.print(f"model [bold]{imported.id}[/] at {imported.path} (sha256 {imported.content_hash[:12]})")
    job = sdk.optimize(imported.id, chosen, wait=False)
    for warning in job.warnings:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if job.reused_from:
        console.print(f"job [bold]{job.name}[/] reuses the artifact of job {job.reused_from}")
    _follow_job(job.name)
    with _evaluation_progress() as events:
        results = sdk.evaluate(compare=[imported.id, str(store.get(job.name).artifact)], dataset="builtin-qa",
                               concurrency=demo_module.CONCURRENCY, requests=requests, output=output, events=events)
    report.table(results, console)
    console.print(demo_module.verdict(results))
    console.print(f"results: {output / report.RESULTS_FILE}  report: {output / report.REPORT_FILE}")


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 1."""
    try:
        app(standalone_mode=False)
    except LlmoptError as exc:
        err.print(f"[red]error:[/] {exc.one_line()}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except (typer.Exit, SystemExit) as exc:
        sys.exit(getattr(exc, "exit_code", getattr(exc, "code", 0)))
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise

"""The `llmopt` command: typer commands over the SDK, nothing more."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from llmopt import catalog, endpoints, paths, sdk, sources
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Optimize, evaluate and deploy LLMs on vLLM.")
models_app = typer.Typer(no_args_is_help=True, help="The model store.")
endpoints_app = typer.Typer(no_args_is_help=True, help="Running endpoints.")
app.add_typer(models_app, name="models")
app.add_typer(endpoints_app, name="endpoints")

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
    console.print(f"stop it with: llmopt endpoints stop {endpoint.name}")


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
    endpoint = endpoints.get(name)
    path = Path(endpoint.log_path)
    if not follow:
        sys.stdout.write(path.read_text(errors="replace"))
        return
    for line in endpoints.follow(path, lambda: endpoints.get(name).status in endpoints.LIVE):
        sys.stdout.write(line)


@endpoints_app.command("stop")
def endpoints_stop(name: str) -> None:
    endpoint = endpoints.stop(name)
    console.print(f"{endpoint.name}: {endpoint.status}")


# -- demo ---------------------------------------------------------------------------------------


@app.command()
def demo(
    model: str = typer.Option(catalog.DEFAULT_MODEL, help="Model to demo."),
    max_tokens: int = typer.Option(64, help="Tokens per answer."),
) -> None:
    """Import the default model, deploy it, ask it a few questions with timings, and stop it."""
    from llmopt import demo as demo_module

    demo_module.run(model, max_tokens, console, _working)


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

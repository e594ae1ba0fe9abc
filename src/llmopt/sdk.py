"""The Python SDK: what users import. The CLI and the studio call these functions and nothing else."""

from __future__ import annotations

from pathlib import Path

from llmopt import artifact, endpoints, serving, sources
from llmopt import recipe as recipes
from llmopt.endpoints import Endpoint
from llmopt.engine import vllm
from llmopt.engine.config import EngineConfig
from llmopt.engine.vllm import DEFAULT_HOST
from llmopt.errors import LlmoptError
from llmopt.jobs import runner
from llmopt.jobs.runner import Job
from llmopt.recipe import Recipe


def import_model(spec: str, name: str | None = None) -> sources.Model:
    """Import a catalogue id, a Hugging Face folder or a GGUF file into the model store."""
    return sources.import_model(spec, name=name)


def deploy(
    model: str,
    name: str | None = None,
    port: int | None = None,
    host: str = DEFAULT_HOST,
    engine: EngineConfig | None = None,
    timeout_s: float = endpoints.DEFAULT_READY_TIMEOUT_S,
) -> Endpoint:
    """Serve a model or an optimized artifact; returns once the endpoint answers.

    `model` is an artifact folder, an imported model, a catalogue id, a Hugging Face folder or a
    GGUF file (the last three are imported on first use).
    """
    spec = serving.for_target(model, engine)
    return endpoints.deploy(spec, name=name, port=port, host=host, timeout_s=timeout_s)


def optimize(
    model: str,
    recipe: Recipe | str | dict = "baseline",
    name: str | None = None,
    output: str | None = None,
    force: bool = False,
    wait: bool = True,
) -> Job:
    """Run a recipe on a model in a background job that writes one self-contained artifact.

    The same recipe on the same source reuses the earlier artifact unless `force` is set.
    """
    if isinstance(recipe, str):
        recipe = recipes.load(recipe)
    elif isinstance(recipe, dict):
        recipe = recipes.parse(recipe)
    job = runner.create(model, recipe, name=name, output=output, force=force)
    return job.wait() if wait else job


def export_command(artifact_dir: str, host: str = DEFAULT_HOST, port: int = 8000) -> str:
    """The plain vLLM command that serves an artifact without llmopt."""
    spec = artifact.load(Path(artifact_dir)).serving_spec()
    return vllm.shell_command(vllm.server_argv(spec.model_path, spec.args(), host, port), spec.env)


def evaluate(
    endpoint: str | None = None,
    url: str | None = None,
    model: str | None = None,
    compare: list[str] | None = None,
    dataset: str = "builtin-qa",
    concurrency: tuple[int, ...] | list[int] = (1, 4),
    requests: int | None = 16,
    duration_s: float | None = None,
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
    events=None,
) -> dict:
    """Load-test one target (an endpoint, a URL, or a model/artifact deployed for the run), or
    compare several models/artifacts deployed in turn; returns the results and writes
    OUTPUT/results.json and OUTPUT/report.html when `output` is given."""
    from llmopt.evaluation import benchmark, metrics, pricing

    chosen = [(v, k) for v, k in ((endpoint, "endpoint"), (url, "url"), (model, "model")) if v]
    if compare:
        chosen += [(item, "model") for item in compare]
    if not chosen or (len(chosen) > 1 and not compare):
        raise LlmoptError("name what to evaluate", "pass exactly one of --endpoint, --url, --model, or --compare A B ...")
    spec = benchmark.EvaluationSpec(
        dataset=dataset, concurrency=tuple(concurrency), requests=None if duration_s else requests, duration_s=duration_s,
        timeout_s=timeout_s, seed=seed, quality=quality, tokenizer=tokenizer,
        goodput=metrics.GoodputTargets(ttft_target_ms, itl_target_ms),
    )
    price = pricing.choose(hardware, price_per_hour, discount, Path(hardware_file) if hardware_file else None)
    return benchmark.run(chosen, spec, price, Path(output) if output else None, events or (lambda *a, **k: None))

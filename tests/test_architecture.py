"""The shape of the code: no import cycles, vLLM's flags and environment known only to `engine/`,
a CLI that reaches only the SDK and presentation, and published schemas that match the types."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from llmopt import techniques
from llmopt.engine import vllm

SRC = Path(__file__).resolve().parent.parent / "src" / "llmopt"
ROOT = SRC.parent.parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every llmopt module a module imports, wherever the import statement sits."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return {m for m in out if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}

    def package_face(c: list[str]) -> bool:  # a package's __init__ and its own module: allowed
        return len(c) == 2 and (c[1].startswith(c[0] + ".") or c[0].startswith(c[1] + "."))

    assert [c for c in _cycles(graph) if not package_face(c)] == []


def test_only_the_engine_layer_knows_vllm_flags_and_environment() -> None:
    # a flag is spotted with or without its dashes when it has several words (max-model-len), else with them (--dtype)
    spotted = [f.removeprefix("--") if "-" in f.removeprefix("--") else f for f in sorted(set(vllm.FLAGS.values()))]
    pattern = re.compile(r"VLLM_|TORCHINDUCTOR_|" + "|".join(re.escape(f) for f in spotted))
    # llmopt's own options may share a name with vLLM's (--chat-template): the CLI may name those
    ours = _cli_options()
    offenders = []
    for path in SRC.rglob("*.py"):
        if "engine" in path.relative_to(SRC).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            hits = {m.group(0) for m in pattern.finditer(line)}
            if path.name == "cli.py":
                hits -= {h for h in hits if "--" + h.removeprefix("--") in ours}
            if hits and "typer.Option(" not in line:
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert offenders == []


def _cli_options() -> set[str]:
    import click
    import typer

    from llmopt import cli

    def walk(command: click.Command) -> set[str]:
        names = {o for p in command.params for o in p.opts if o.startswith("--")}
        for sub in getattr(command, "commands", {}).values():
            names |= walk(sub)
        return names

    return walk(typer.main.get_command(cli.app))


def test_the_engine_launcher_does_not_load_the_sdk() -> None:
    """Every server start imports the launcher's package twice (API server, engine core): the SDK
    behind `llmopt`'s names loads on first use (0.56 s of imports when it loaded eagerly)."""
    import subprocess

    loaded = subprocess.run([sys.executable, "-c", "import sys, llmopt, llmopt.engine; print(sorted(sys.modules))"],
                            capture_output=True, text=True, check=True).stdout
    assert "'llmopt.sdk'" not in loaded and "'llmopt.recipe'" not in loaded
    used = subprocess.run([sys.executable, "-c", "import llmopt; print(llmopt.Recipe.__name__, callable(llmopt.deploy))"],
                          capture_output=True, text=True, check=True).stdout
    assert used.split() == ["Recipe", "True"]


def test_the_cli_reaches_only_the_sdk_and_presentation() -> None:
    """The studio is the other face over the SDK: the CLI may start it, nothing more."""
    modules = _modules()
    used = _imports("llmopt.cli", SRC / "cli.py", modules)
    assert {m for m in used if m not in ("llmopt.sdk", "llmopt.studio.app") and not m.startswith("llmopt.presentation")} == set()


def test_the_studio_acts_only_through_the_sdk() -> None:
    """Pages and API read records and results, but every action goes through the SDK."""
    modules = _modules()
    acting = {"llmopt.jobs.runner", "llmopt.serving", "llmopt.endpoints", "llmopt.evaluation.benchmark", "llmopt.recommendation.search"}
    for name, path in modules.items():
        if name.startswith("llmopt.studio"):
            assert not _imports(name, path, modules) & acting, name


def test_no_technique_is_named_outside_its_module_and_the_registry() -> None:
    """Planning, checking, keying, measuring and verifying loop over the registry."""
    sections = {t.section for t in techniques.REGISTRY}
    looping = ["techniques/measure.py", "jobs/pipeline.py", "jobs/runner.py", "serving.py", "endpoints.py", "artifact.py",
               "compatibility.py"]
    for relative in looping:
        tree = ast.parse((SRC / relative).read_text())
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not attributes & sections, (relative, attributes & sections)


def test_published_schemas_are_current() -> None:
    spec = importlib.util.spec_from_file_location("write_schemas", ROOT / "scripts" / "schemas.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["write_schemas"] = module
    spec.loader.exec_module(module)
    for name, schema in module.schemas().items():
        path = ROOT / "schemas" / name
        assert path.is_file() and path.read_text() == module.render(schema), \
            f"schemas/{name} is stale: run `.venv/bin/python scripts/schemas.py`"


@pytest.mark.parametrize("section", [t.section for t in techniques.REGISTRY])
def test_every_technique_has_a_matrix_row(section: str) -> None:
    from llmopt import compatibility

    names = {row.technique.split(".")[0] for row in compatibility.matrix()}
    assert section in names

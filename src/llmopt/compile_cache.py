"""The compile cache: compiled engine artifacts, stored by a key of everything that makes them valid.

An entry is a folder `$LLMOPT_HOME/compile-cache/<key>/` holding vLLM's and Inductor's cache
folders for one (model weights, quantization, shapes, parallelism, vLLM, torch, CPU flags or GPU
kind) combination, and `key.json` naming those components. A start whose key differs gets a
different, empty entry: stale artifacts are never loaded, because nothing points the engine at
them.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt import hashing, paths
from llmopt.engine import platform
from llmopt.errors import LlmoptError

KEY_FILE = "key.json"


def key_components(weights_hash: str, engine_args: dict[str, Any], hardware: platform.Hardware) -> dict[str, Any]:
    """What compiled artifacts depend on. Engine flags that change the compiled graph are included
    whole (shapes, dtype, quantization, KV cache dtype, speculation, parallelism); the served name
    and the seed are not."""
    import importlib.metadata as md

    from llmopt.engine import vllm

    relevant = {k: v for k, v in sorted(engine_args.items()) if k not in ("served-model-name", "seed")}
    engine_name, engine_version = vllm.engine_name_version()
    return {
        "weights": weights_hash,
        "engine_args": relevant,
        "engine": f"{engine_name}=={engine_version}",
        "torch": md.version("torch"),
        "device": hardware.device,
        "cpu_flags": list(hardware.cpu_flags) if hardware.device == "cpu" else [],
        "gpu": hardware.gpu,
        "gpu_count": hardware.gpu_count,
    }


def key_of(components: dict[str, Any]) -> str:
    return hashing.json_sha256(components)


def root() -> Path:
    path = paths.home() / "compile-cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def entry(components: dict[str, Any]) -> Path:
    """The entry for these components, created empty if it does not exist yet."""
    folder = root() / key_of(components)
    folder.mkdir(exist_ok=True)
    key_file = folder / KEY_FILE
    if not key_file.exists():
        key_file.write_text(json.dumps({"components": components, "created_at": time.time()}, indent=2))
    (folder / "last-used").write_text(str(time.time()))
    return folder


def engine_env(folder: Path) -> dict[str, str]:
    """Point vLLM and Inductor at one entry's folders."""
    return {"VLLM_CACHE_ROOT": str(folder / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}


def seed_from(folder: Path, snapshot: Path) -> None:
    """Fill an entry from an artifact's compile-cache snapshot, if the entry has no artifacts yet."""
    for part in ("vllm", "inductor"):
        src, dest = snapshot / part, folder / part
        if src.is_dir() and not dest.exists():
            shutil.copytree(src, dest)
            for path in dest.rglob("*"):
                path.chmod(path.stat().st_mode | 0o200)


def snapshot_into(folder: Path, dest: Path) -> None:
    """Copy an entry's compiled artifacts into an artifact folder (its compile-cache/)."""
    for part in ("vllm", "inductor"):
        if (folder / part).is_dir():
            shutil.copytree(folder / part, dest / part, ignore=shutil.ignore_patterns("*.lock", "*.tmp"))
    shutil.copy(folder / KEY_FILE, dest / KEY_FILE)


@dataclass
class Entry:
    key: str
    path: Path
    size_bytes: int
    created_at: float
    last_used: float
    components: dict[str, Any]


def list_entries() -> list[Entry]:
    found = []
    for folder in sorted(root().iterdir()):
        key_file = folder / KEY_FILE
        if not key_file.is_file():
            continue
        data = json.loads(key_file.read_text())
        last = folder / "last-used"
        found.append(Entry(
            key=folder.name, path=folder,
            size_bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
            created_at=data["created_at"],
            last_used=float(last.read_text()) if last.exists() else data["created_at"],
            components=data["components"],
        ))
    return found


def prune(older_than_days: float | None = None, stale_versions: bool = False, everything: bool = False) -> list[Entry]:
    """Remove entries unused for a while, built by another engine/torch, or all of them."""
    if not (older_than_days is not None or stale_versions or everything):
        raise LlmoptError("say what to prune", "pass --older-than DAYS, --stale or --all")
    import importlib.metadata as md

    from llmopt.engine import vllm

    engine_name, engine_version = vllm.engine_name_version()
    current = (f"{engine_name}=={engine_version}", md.version("torch"))
    cutoff = time.time() - (older_than_days or 0) * 86400
    removed = []
    for item in list_entries():
        stale = (item.components["engine"], item.components["torch"]) != current
        if everything or (older_than_days is not None and item.last_used < cutoff) or (stale_versions and stale):
            shutil.rmtree(item.path)
            removed.append(item)
    return removed

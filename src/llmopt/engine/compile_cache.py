"""The compile cache: torch.compile/Inductor artifacts of vLLM engine starts, one folder per key,
where the key is everything that makes compiled code valid.

Each entry holds vLLM's own saved compiled model (`VLLM_USE_AOT_COMPILE`: Dynamo's trace and
Inductor's code together, under VLLM_CACHE_ROOT), so a precompiled start neither traces nor
compiles. vLLM 0.32 cannot load that on CPU by itself; the server llmopt starts
(`engine/serve.py`, `vllm.LOCAL_SERVER_MODULE`) carries the fix, and so the entry's environment
goes with that server only. vLLM checks the traced source files when it loads, and the key here
keeps entries for different architectures, quantizations, shapes and machines apart,
countable and prunable.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel

from llmopt import hashing, paths
from llmopt.engine import kernels, platform, vllm
from llmopt.engine.config import EngineConfig

logger = logging.getLogger(__name__)

SCHEMA = 4  # 4: weights by layout (3: by content; vLLM's saved compiled model; 2: Inductor's FX-graph cache only)
KEY_FILE = "key.json"
LOCK_FILE = ".lock"
STARTING_FILE = ".starting"  # present while a start that may compile is under way
ARTIFACT_DIR = "compile-cache"  # an artifact's own copy of its entry
COMPILED_DIRS = ("inductor", "vllm")
# Settings that change neither compiled code nor vLLM's key for its saved model (which leaves out
# VLLM_CPU_KVCACHE_SPACE and VLLM_ENABLE_V1_MULTIPROCESSING but keys the reserved cores' variable).
IRRELEVANT_SETTINGS = frozenset({"seed", "gpu_memory_utilization", "preload", "kv_cache_gib", "executor", "stream_interval",
                                 "attention_kernel"})  # attention runs outside the compiled graph
SERVED_DIR = ".served"  # per key: the links through which every start names its model
KERNELS_DIR = ".kernels"  # Inductor's compiled C++ kernels by Inductor's name for them, per torch version, shared by every entry
MODEL_INFOS_DIR = ".model-infos"  # vLLM's facts about a model class, by the hash of its source file, shared by every entry
ISA_PROBE_MARK, ISA_PROBE_MAX_BYTES = "_chk_kernel", 1024  # what each of Inductor's instruction-set checks defines
# Speculation settings that change no compiled graph: how many tokens are proposed and how they are
# looked up only change how many tokens a step verifies, a dynamic shape (vLLM's own key for its
# saved model keeps the method's kind and the draft's config, not these, on CPU; on a GPU its key
# also holds CUDA-graph sizes derived from them, and a start there reports "partly compiled"). n-gram
# speculation itself changes no graph either: its entry is the plain model's.
UNCOMPILED_SPECULATION = frozenset({"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "schedule"})


def weights_layout(model_path: str | Path) -> str:
    """What compiled code is built from: config.json (so the quantization) and every tensor's name,
    dtype and shape, not the weights' values, which vLLM hands its compiled graphs as inputs (its
    own key leaves them out too; on CPU that holds while Inductor's `freezing` stays off, which
    vLLM turns on only for max-autotune, a setting llmopt does not expose). A model quantized again
    with other calibration data (llmopt's schemes scale activations at run time), or a fine-tune of
    the same architecture, starts from the same entry. One-element tensors (a KV cache or static
    activation scale) count by value, since a traced graph may fold such a number in; weight files
    other than safetensors count by content."""
    root = Path(model_path)
    if not root.is_dir():
        raise FileNotFoundError(f"no model folder at {root}")
    tensors: dict[str, Any] = {}
    for path in sorted(root.iterdir()):
        if path.suffix == ".safetensors":
            tensors.update(_tensor_layout(path))
        elif path.suffix in (".bin", ".pt", ".pth"):
            tensors[path.name] = hashing.remembered_sha256(path)
    return hashing.json_sha256([sorted(tensors.items()), _graph_config(root / "config.json")])


def _graph_config(path: Path) -> Any:
    """config.json without the fields that only say where and with what it was written."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
        return {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    except (ValueError, AttributeError):
        return hashing.remembered_sha256(path)


def _tensor_layout(path: Path) -> dict[str, Any]:
    """Each tensor's dtype and shape from a safetensors header (and a one-element tensor's bytes);
    a file whose header does not parse counts by its content, and vLLM then says what is wrong."""
    with path.open("rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        data = path.stat().st_size - 8 - size
        try:
            if size <= 0 or data < 0:
                raise ValueError("no safetensors header")
            layout = {}
            for name, tensor in json.loads(f.read(size)).items():
                if name == "__metadata__":
                    continue
                start, end = tensor["data_offsets"]
                value = None
                if math.prod(tensor["shape"]) == 1:
                    if not 0 <= start <= end <= data:
                        raise ValueError("a tensor outside the file")
                    f.seek(8 + size + start)
                    value = f.read(end - start).hex()
                layout[name] = [tensor["dtype"], tensor["shape"], value]
            return layout
        except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError):
            return {path.name: hashing.remembered_sha256(path)}


def components(model_path: str | Path, config: EngineConfig, hw: platform.Hardware, engine: tuple[str, str],
               torch_version: str) -> dict[str, Any]:
    """Everything a compiled artifact depends on: the weights' layout (and so the quantization), the
    settings that shape the graphs (lengths, batch, dtypes, tensor parallelism, a draft model; not
    n-gram speculation, which leaves the model's graph plain), the engine and torch versions, the
    linear kernels' build, and the CPU flags or GPU kind. `config` has its paths located."""
    relevant = config.model_dump(mode="json", exclude=set(IRRELEVANT_SETTINGS))
    if hw.device == "cpu":  # the kernels chosen here are ops in the traced graph
        relevant["linear_kernels"] = linear_build(config, hw)
    relevant["compilation"]["wrapper"] = vllm.graph_wrapper(config, hw)  # Inductor's generated code differs
    relevant["compilation"]["graph"] = vllm.compiled_graph(config, hw)
    relevant["dtype"] = vllm.dtype(config, hw)
    spec = relevant.get("speculative")
    if spec:
        spec = {k: v for k, v in spec.items() if k not in UNCOMPILED_SPECULATION}
        if spec.get("model"):
            relevant["speculative"] = {**spec, "model": weights_layout(Path(spec["model"]))}
        else:  # n-gram proposes outside the model: its graph is the plain one (and so is vLLM's key, engine/serve.py)
            relevant["speculative"] = None if spec.get("method") == "ngram" else spec
    return {
        "schema": SCHEMA,
        "weights": weights_layout(model_path),
        "settings": relevant,
        "engine": list(engine),
        "torch": torch_version,
        "device": hw.device,
        "cpu_flags": list(hw.cpu_flags),
        "gpu": hw.gpu,
    }


def linear_build(config: EngineConfig, hw: platform.Hardware) -> str:
    """The linear kernels chosen here on a CPU, which are ops in the traced graph; llmopt's named
    with their library's build too, since a changed library calls other ops (a float32 layer on
    AVX2 ran oneDNN before the bf16-held kernel) and must compile anew."""
    linear = vllm.linear_kernels(config, hw)
    return f"{linear} {kernels.library_path(platform.kernel_library(hw)).name}" if linear == "llmopt" else linear


def key_of(parts: dict[str, Any]) -> str:
    return hashing.json_sha256(parts)


class Start(BaseModel):
    """One engine start against a compile-cache entry: served from the cache, or compiled."""

    key: str
    outcome: Literal["precompiled", "compiled", "partly compiled"]
    compiled_files_added: int  # Inductor's instruction-set probes aside (`_isa_probe`)
    ready_seconds: float
    cold_ready_seconds: float | None = None  # the entry's first, compiling start
    discarded_interrupted_compile_files: int = 0
    phases: dict[str, float] = {}  # seconds by phase of the start, from the server's log (`vllm.start_phases`)
    kernels_reused: int = 0  # Inductor's C++ kernels copied from earlier compiles, not built (`vllm.kernels_reused`)


@dataclass
class Entry:
    key: str
    path: Path
    components: dict[str, Any]

    @property
    def env(self) -> dict[str, str]:
        """For a start by `vllm.LOCAL_SERVER_MODULE`: vLLM points Inductor's own cache into its
        saved model's folder; Inductor's folder here takes what compiles outside that. The kept
        C++ kernels every entry of this torch version shares (`engine/serve.py`) go by name only,
        which does not hash torch's headers: they are kept apart by torch's version. vLLM's facts
        about a model class, which it keeps under its cache root and learns in a subprocess that
        imports vLLM again (11-12 s of a start on a Zen 3 EPYC), go by the hash of the class's
        source file, so every entry shares one folder of them, as vLLM's own default root does."""
        return {
            "VLLM_USE_AOT_COMPILE": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(self.path / "inductor"),
            "VLLM_CACHE_ROOT": str(self.path / "vllm"),
            platform.INDUCTOR_KERNELS_ENV: str(root() / KERNELS_DIR / str(self.components["torch"])),
            platform.MODEL_INFOS_ENV: str(root() / MODEL_INFOS_DIR),
        }

    def compiled_files(self) -> set[str]:
        """Compiled models, graphs and kernels stored so far (lock files excluded)."""
        return {p.relative_to(self.path).as_posix() for folder in COMPILED_DIRS for p in (self.path / folder).rglob("*")
                if p.is_file() and "locks" not in p.parts}

    def compiled_state(self, names: set[str] | None = None) -> str:
        """The compiled files' (or `names`') names, sizes and times of change, as one hash (a file
        gone between listing and reading counts as gone)."""
        found = []
        for name in sorted(self.compiled_files() if names is None else names):
            try:
                stat = (self.path / name).stat()
            except FileNotFoundError:
                continue
            found.append((name, stat.st_size, stat.st_mtime_ns))
        return hashing.json_sha256(found)

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / KEY_FILE).read_text())

    def record(self, **fields: Any) -> None:
        meta = {**self.meta, **fields}
        (self.path / KEY_FILE).write_text(json.dumps(meta, indent=2))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


class Watch:
    """One engine start against an entry: was it served from the cache, or did it compile?

    Starts of one key take turns (a file lock held until the engine is ready), so the second of
    two finds the first's graphs. A start that never got ready (killed mid-compile, crashed) may
    have left a compiled library cut short, which Inductor would then fail to load ("file too
    short") on every later start: its marker outlives it, and the next start discards the entry's
    compiled files and compiles afresh. The marker holds the state of the compiled files when that
    start began, so a start killed before it wrote anything (a job's worker or a deploying command
    killed while a precompiled engine started) costs the next one nothing."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self._lock: IO[str] | None = open(entry.path / LOCK_FILE, "a")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        marker = entry.path / STARTING_FILE
        self.discarded = 0
        self.before = entry.compiled_files()
        self._state = entry.compiled_state(self.before)
        if marker.exists() and _recorded_state(marker) != self._state:
            self.discarded = len(self.before)
            for folder in COMPILED_DIRS:
                shutil.rmtree(entry.path / folder, ignore_errors=True)
            self.before = set()
            self._state = entry.compiled_state(self.before)
        marker.write_text(json.dumps({"pid": os.getpid(), "compiled": self._state}))

    def ready(self, ready_seconds: float, started_at: float = 0.0, log_path: Path | None = None) -> "Start":
        """The engine answered: what it compiled is whole. Lets the next start of this key go. Its
        phases and the kernels it copied are read from the server's log (`log_path`), where given."""
        added = sum(not _isa_probe(self.entry.path / name) for name in self.entry.compiled_files() - self.before)
        if not self.before:
            self.entry.record(cold_ready_seconds=ready_seconds)
        (self.entry.path / STARTING_FILE).unlink(missing_ok=True)
        self.close()
        log_text = _log_text(log_path)  # after the lock goes: a log that cannot be read leaves no start waiting
        outcome = "precompiled" if self.before and not added else "compiled" if not self.before else "partly compiled"
        return Start(key=self.entry.key, outcome=outcome, compiled_files_added=added, ready_seconds=ready_seconds,
                     cold_ready_seconds=self.entry.meta.get("cold_ready_seconds"),
                     discarded_interrupted_compile_files=self.discarded,
                     phases=vllm.start_phases(log_text, started_at, ready_seconds) if log_text else {},
                     kernels_reused=vllm.kernels_reused(log_text))

    def served(self, model_path: str, config: EngineConfig) -> tuple[str, EngineConfig]:
        """The model's path (and the draft's) as this start gives them to vLLM: a link, the same for
        every start of the key, pointed at this start's files. vLLM keys its saved compiled model by
        the model's path among the rest, so without it an artifact compiled in a job's work folder
        would compile again when deployed from the artifacts folder. Models of one layout share the
        link, which points at the last one started: a running server has read its model's files by
        the time it is ready (the lock is held until then), and reads none later."""
        folder = root() / SERVED_DIR / self.entry.key
        folder.mkdir(parents=True, exist_ok=True)
        spec = config.speculative
        if spec is not None and spec.model and Path(spec.model).exists():
            config = config.model_copy(update={"speculative": spec.model_copy(update={"model": _link(folder / "draft", spec.model)})})
        return _link(folder / "model", model_path), config

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let the next start go; a start that ended before ready without writing anything left nothing to discard."""
        if self._lock is None:
            return
        marker = self.entry.path / STARTING_FILE
        if marker.exists() and self.entry.compiled_state() == self._state:
            marker.unlink()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None


def _log_text(log_path: Path | None) -> str:
    """A server's log as far as it was written; one never written tells nothing, like an empty one."""
    if log_path is None:
        return ""
    try:
        return log_path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _isa_probe(path: Path) -> bool:
    """One of Inductor's checks that the compiler builds for an instruction set (`cpu_vec_isa`: a
    few lines of C++ and their library), not a piece of the model. A process builds each check once
    for every set of flags it asks about, in whatever Inductor cache is current when it first asks:
    a start can build one that the entry's compiling start built elsewhere or with other flags (a
    piecewise graph's start asks before vLLM points Inductor into its saved model, `piecewise.use`)."""
    source = path.with_suffix(".cpp")
    try:
        return source.stat().st_size < ISA_PROBE_MAX_BYTES and ISA_PROBE_MARK in source.read_text(errors="replace")
    except OSError:
        return False


def _recorded_state(marker: Path) -> str | None:
    """The compiled files' state when the start that left `marker` began (None from an older
    llmopt's marker, which holds only a pid: it never matches, so its entry is discarded)."""
    try:
        return json.loads(marker.read_text()).get("compiled")
    except (ValueError, AttributeError):
        return None


def _link(link: Path, target: str) -> str:
    """Point `link` at `target`, replacing what it pointed at in one step."""
    staged = link.with_name(f".{link.name}-{os.getpid()}")
    staged.unlink(missing_ok=True)
    staged.symlink_to(Path(target).resolve())
    os.replace(staged, link)
    return str(link)


def root() -> Path:
    folder = paths.home() / "compile-cache"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def entry_for(model_path: str | Path, config: EngineConfig, hw: platform.Hardware, trusted: bool = False) -> Entry:
    """The entry for this start, created empty when new, or seeded from the artifact's own copy
    when the artifact was compiled for exactly this key (another machine's cache, say) and its
    compiled code is `trusted`: that copy is code the engine runs (pickled functions, C++ libraries
    it loads), which a crafted artifact could fill with anything; untrusted, the start compiles."""
    parts = components(model_path, config, hw, vllm.engine_name_version(), platform.torch_version())
    key = key_of(parts)
    path = root() / key
    if not (path / KEY_FILE).is_file():
        shipped = Path(model_path) / ARTIFACT_DIR
        staging = root() / f".new-{key}-{time.monotonic_ns()}"
        matches = (shipped / KEY_FILE).is_file() and json.loads((shipped / KEY_FILE).read_text()).get("key") == key
        if matches and not trusted:
            logger.warning("%s: the artifact's compiled code is not loaded, as no job of this home built it; "
                           "this start compiles (`llmopt deploy --trust-compiled-code` loads it)", model_path)
        if matches and trusted:
            shutil.copytree(shipped, staging)
            _writable(staging)
        else:
            staging.mkdir()
            (staging / KEY_FILE).write_text(json.dumps({"key": key, "components": parts, "created_at": time.time()}, indent=2))
        try:
            staging.rename(path)
        except OSError:  # another start created it first
            shutil.rmtree(staging, ignore_errors=True)
    (path / KEY_FILE).touch()  # last used
    return Entry(key, path, parts)


def export(entry: Entry, dest: Path) -> None:
    """Copy an entry into an artifact, so the artifact carries its compiled code."""
    shutil.copytree(entry.path, dest, ignore=shutil.ignore_patterns("locks", LOCK_FILE, STARTING_FILE))


class EntryInfo(BaseModel):
    """An entry as `llmopt cache list` shows it."""

    key: str
    weights: str
    max_model_len: int | None
    max_num_seqs: int | None
    engine: str
    size_bytes: int
    cold_ready_seconds: float | None
    last_used: float


def describe(entry: Entry) -> EntryInfo:
    settings = entry.components.get("settings", {})
    return EntryInfo(key=entry.key, weights=entry.components.get("weights", ""), max_model_len=settings.get("max_model_len"),
                     max_num_seqs=settings.get("max_num_seqs"), engine=" ".join(entry.components.get("engine", [])),
                     size_bytes=entry.size_bytes(), cold_ready_seconds=entry.meta.get("cold_ready_seconds"),
                     last_used=(entry.path / KEY_FILE).stat().st_mtime)


class KeptKernels(BaseModel):
    """Inductor's C++ kernel libraries kept for every entry of one torch version (`engine/serve.py`):
    no entry's size counts them."""

    torch: str
    libraries: int
    size_bytes: int


def kept_kernels() -> list[KeptKernels]:
    found = []
    for folder in _kernel_folders():
        libraries = list(folder.glob("*.so"))
        found.append(KeptKernels(torch=folder.name, libraries=len(libraries), size_bytes=sum(p.stat().st_size for p in libraries)))
    return found


def _kernel_folders() -> list[Path]:
    """The kept kernels' folders, one per torch version; none before a compile kept any."""
    kernels = root() / KERNELS_DIR
    return sorted(p for p in kernels.iterdir() if p.is_dir()) if kernels.is_dir() else []


def list_entries() -> list[Entry]:
    found = []
    for path in sorted(root().iterdir()):
        if (path / KEY_FILE).is_file():
            meta = json.loads((path / KEY_FILE).read_text())
            found.append(Entry(meta["key"], path, meta["components"]))
    return found


def prune(older_than_s: float | None = None, keep: frozenset[str] = frozenset()) -> list[EntryInfo]:
    """Remove entries unused for `older_than_s` (every entry when None), except `keep`; returns
    what was removed."""
    removed = []
    now = time.time()
    for entry in list_entries():
        if entry.key in keep:
            continue
        if older_than_s is not None and now - (entry.path / KEY_FILE).stat().st_mtime < older_than_s:
            continue
        removed.append(describe(entry))
        shutil.rmtree(entry.path)
        shutil.rmtree(root() / SERVED_DIR / entry.key, ignore_errors=True)
    versions = {str(entry.components["torch"]) for entry in list_entries()}
    for folder in _kernel_folders():
        if folder.name not in versions:  # kept for entries of a torch no entry has any more
            shutil.rmtree(folder, ignore_errors=True)
    return removed


def _writable(folder: Path) -> None:
    """Artifacts are read-only; the cache entry copied out of one must take new graphs."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)


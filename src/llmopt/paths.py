"""Where llmopt keeps its state: one home folder, configurable, under the user's cache by default;
and how a state file is written: replaced whole, so no reader sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HOME_ENV = "LLMOPT_HOME"


def home() -> Path:
    """The llmopt home: $LLMOPT_HOME, else $XDG_CACHE_HOME/llmopt, else ~/.cache/llmopt. Created
    readable by its owner alone: it holds the records (API keys among them), logs and weights."""
    explicit = os.environ.get(HOME_ENV)
    if explicit:
        root = Path(explicit)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(cache) / "llmopt"
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
    return root


def models_dir() -> Path:
    return _sub("models")


def artifacts_dir(create: bool = True) -> Path:
    return _sub("artifacts") if create else home() / "artifacts"


def logs_dir() -> Path:
    return _sub("logs")


def db_path() -> Path:
    return home() / "llmopt.db"


def _sub(name: str) -> Path:
    path = home() / name
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def engine_fact(name: str) -> Path:
    """Where a fact about this machine or engine is kept once learnt (slow to learn, cheap to read)."""
    return home() / "engine-facts" / name


def keep_fact(path: Path, text: str) -> None:
    """Keep a fact for next time, if the home can take it; one that cannot is learnt again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError:
        pass


def write_atomic(path: Path, text: str, private: bool = False) -> None:
    """Write `path` through a temporary file beside it and a rename: a reader (or a process that
    dies mid-write) sees the old file or the new one, never a part; concurrent writers each rename
    a whole file of their own. A `private` file is readable by its owner alone; any other follows
    the user's umask, as a plain write would."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            if not private:
                os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            f.write(text)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once, at import, before any thread could race the two calls

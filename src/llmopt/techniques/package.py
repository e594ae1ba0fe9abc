"""The weights step of a recipe that does not rewrite them: the source model's files, copied as they are."""

from __future__ import annotations

import shutil
from pathlib import Path

from llmopt.techniques.base import BuildContext, Step


def copy_weights(ctx: BuildContext) -> None:
    files = sorted(p for p in Path(ctx.source.path).rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files) or 1
    done = 0
    for path in files:
        dest = ctx.workdir / path.relative_to(ctx.source.path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        done += path.stat().st_size
        ctx.progress(done / total)
    ctx.log.info("copied %d files (%.0f MB) from %s", len(files), total / 1e6, ctx.source.path)


STEP = Step("weights", copy_weights, writes_weights=True)

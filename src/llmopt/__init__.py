"""llmopt: optimize, evaluate and deploy LLMs on vLLM, with measured proof.

    import llmopt
    with llmopt.deploy("smollm2-135m-instruct") as endpoint:
        print(endpoint.url)

Everything here is the SDK (`llmopt.sdk`) and the recipe's section types, imported on first use:
a process that runs one module of llmopt's without the SDK (the engine's launcher, which every
server start imports twice, in its API server and in its engine core) does not pay for it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

# the recipe and its section types, by the module that defines each
_SECTIONS = {
    "Recipe": "llmopt.recipe",
    "AWQ": "llmopt.techniques.quantization.schemes",
    "FP8": "llmopt.techniques.quantization.schemes",
    "Calibration": "llmopt.techniques.quantization.schemes",
    "SmoothQuant": "llmopt.techniques.quantization.schemes",
    "ChunkedPrefill": "llmopt.techniques.chunked_prefill",
    "Compilation": "llmopt.techniques.compilation",
    "KVCache": "llmopt.techniques.kv_cache",
    "Sharding": "llmopt.techniques.sharding",
    "DraftModel": "llmopt.techniques.speculative",
    "NGram": "llmopt.techniques.speculative",
    "SpeculationSweep": "llmopt.techniques.speculative",
}


def __getattr__(name: str) -> Any:
    value = _resolve(name)
    globals()[name] = value  # found once: later reads are plain attribute reads
    return value


def _resolve(name: str) -> Any:
    if name in _SECTIONS:
        return getattr(importlib.import_module(_SECTIONS[name]), name)
    if name.startswith("__") and name != "__all__" or "." in name:
        raise AttributeError(f"module 'llmopt' has no attribute {name!r}")
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    if spec is not None and spec.origin is not None:  # a module not imported yet (`from llmopt import x`): the import system loads it
        raise AttributeError(f"module 'llmopt' has no attribute {name!r}")
    sdk = importlib.import_module("llmopt.sdk")
    if name == "__all__":
        return [*sdk.__all__, *_SECTIONS]
    if name in sdk.__all__:
        return getattr(sdk, name)
    raise AttributeError(f"module 'llmopt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_resolve("__all__")})

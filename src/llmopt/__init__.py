"""llmopt: optimize, evaluate and deploy LLMs on vLLM, with measured proof.

    import llmopt
    with llmopt.deploy("smollm2-135m-instruct") as endpoint:
        print(endpoint.url)

Everything here is the SDK (`llmopt.sdk`) and the recipe's section types.
"""

from llmopt.recipe import Recipe
from llmopt.sdk import *  # noqa: F403
from llmopt.sdk import __all__ as _sdk
from llmopt.techniques.chunked_prefill import ChunkedPrefill
from llmopt.techniques.compilation import Compilation
from llmopt.techniques.kv_cache import KVCache
from llmopt.techniques.quantization.schemes import AWQ, FP8, Calibration, SmoothQuant
from llmopt.techniques.sharding import Sharding
from llmopt.techniques.speculative import DraftModel, NGram, SpeculationSweep

__version__ = "0.1.0"

__all__ = [
    *_sdk,
    "AWQ",
    "FP8",
    "Calibration",
    "ChunkedPrefill",
    "Compilation",
    "DraftModel",
    "KVCache",
    "NGram",
    "Recipe",
    "Sharding",
    "SmoothQuant",
    "SpeculationSweep",
]

"""llmopt: optimize, evaluate and deploy LLMs on vLLM, with measured proof.

    import llmopt
    with llmopt.deploy("smollm2-135m-instruct") as endpoint:
        print(endpoint.url)
"""

from llmopt.endpoints import Endpoint
from llmopt.engine.config import EngineConfig
from llmopt.errors import LlmoptError
from llmopt.recipe import (
    AWQ, FP8, Calibration, Compilation, DraftModel, KVCache, NGram, Recipe, Sharding, SmoothQuant, SpeculationSweep,
)
from llmopt.jobs.runner import Job
from llmopt.sdk import deploy, evaluate, export_command, import_model, optimize

__version__ = "0.1.0"

__all__ = [
    "AWQ",
    "FP8",
    "Calibration",
    "Compilation",
    "DraftModel",
    "Endpoint",
    "Job",
    "EngineConfig",
    "KVCache",
    "LlmoptError",
    "NGram",
    "Recipe",
    "Sharding",
    "SmoothQuant",
    "SpeculationSweep",
    "deploy",
    "evaluate",
    "export_command",
    "import_model",
    "optimize",
]

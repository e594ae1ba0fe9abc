"""The quantization step: llm-compressor's oneshot over the source weights, written as a
compressed-tensors checkpoint that vLLM loads as it is.

llm-compressor runs in the job's worker process (one environment with vLLM; see the README for
why). It is imported lazily: only quantizing jobs pay for it.
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from llmopt.errors import LlmoptError
from llmopt.recipe import Quantization
from llmopt.sources import Model
from llmopt.techniques import BuildContext, calibration, schemes

RUNTIME_BYTES = 1.5e9  # torch, transformers and llm-compressor imported, before any model
ACTIVATION_COPIES = 12  # bf16 hidden-state copies per calibrated token (layer inputs, outputs, AWQ's cached args)


def estimate_peak_bytes(q: Quantization, config: dict, weight_bytes: int) -> int:
    """What quantizing needs at its peak: the bf16 model, its compressed copy while saving, the
    calibration activations the sequential pipeline keeps for every sample, and the largest
    per-layer GPTQ Hessian. An upper bound from the requested calibration size."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    estimate = RUNTIME_BYTES + 3 * weight_bytes
    if schemes.needs_calibration(q):
        cal = q.calibration  # type: ignore[union-attr]
        estimate += cal.samples * cal.sequence_length * hidden * 2 * ACTIVATION_COPIES
        estimate += heads * cal.sequence_length**2 * 4 * 2  # one sample's attention scores, fp32, forward and softmax
        estimate += sum(4 * w * w for w in schemes.LayerShapes.from_config(config).inputs) * 3
    return int(estimate)


def check_memory(q: Quantization, config: dict, weight_bytes: int) -> str | None:
    """A refusal when the estimate exceeds the memory available now, else None."""
    needed = estimate_peak_bytes(q, config, weight_bytes)
    available = psutil.virtual_memory().available
    if needed <= available:
        return None
    detail = ""
    if schemes.needs_calibration(q):
        cal = q.calibration  # type: ignore[union-attr]
        detail = f" with {cal.samples} calibration samples of {cal.sequence_length} tokens"
    return (
        f"quantization.{q.method} needs about {needed / 2**30:.1f} GiB{detail} but {available / 2**30:.1f} GiB "
        "is available; use fewer calibration samples or shorter sequences, or a machine with more memory"
    )


def apply(ctx: BuildContext) -> None:
    q = ctx.recipe.quantization
    assert q is not None
    ctx.metrics["quantization"] = quantize_model(q, ctx.source, ctx.workdir, ctx.recipe.tensor_parallel_size, ctx.log, ctx.progress)


def quantize_model(q: Quantization, source_model: Model, dest: Path, tensor_parallel: int,
                   log: logging.Logger, progress: Callable[[float], None]) -> dict[str, Any]:
    """Quantize a model folder into `dest` as a compressed-tensors checkpoint; returns what the
    manifest records about it. The target of a recipe and a draft model both go through here."""
    source = Path(source_model.path)
    config = json.loads((source / "config.json").read_text())
    fitted = schemes.fit(q, config, tensor_parallel)
    if fitted.note:
        log.warning(fitted.note)

    started = time.monotonic()
    oneshot = load_llmcompressor()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    kwargs: dict[str, Any] = {}
    record: dict[str, Any] = {"method": q.method, **q.model_dump(mode="json", exclude={"calibration"})}
    if schemes.needs_calibration(q):
        cal = calibration.build(q.calibration, tokenizer)  # type: ignore[union-attr]
        record["calibration"] = cal.description
        log.info("calibration: %s", cal.description)
        kwargs.update(dataset=_dataset(cal.windows), num_calibration_samples=len(cal.windows),
                      max_seq_length=cal.description["sequence_length"])
    record.update(group_size=fitted.group_size, block_size=fitted.block_size, fit_note=fitted.note)
    record = {k: v for k, v in record.items() if v is not None}

    progress(0.05)
    with _LayerProgress(model, progress, passes=2 if schemes.needs_calibration(q) else 0,
                        samples=kwargs.get("num_calibration_samples", 0)):
        oneshot(model=model, recipe=schemes.modifiers(q, fitted), tokenizer=tokenizer, **kwargs)
    progress(0.9)
    _copy_non_weight_files(source, dest)
    model.save_pretrained(dest, save_compressed=True)
    tokenizer.save_pretrained(dest)
    (dest / "recipe.yaml").unlink(missing_ok=True)  # llm-compressor's own; the manifest has ours

    record["seconds"] = round(time.monotonic() - started, 1)
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record["estimated_peak_bytes"] = estimate_peak_bytes(q, config, source_model.size_bytes)  # as the compatibility check saw it
    record["size_bytes"] = _weight_bytes(dest)
    record["source_size_bytes"] = _weight_bytes(source)
    log.info("quantized %s (%s) in %.0f s; weights %.0f MB -> %.0f MB; peak memory %.2f GiB", source_model.id,
             q.method, record["seconds"], record["source_size_bytes"] / 1e6, record["size_bytes"] / 1e6,
             record["peak_rss_bytes"] / 2**30)
    progress(1.0)
    return record


def load_llmcompressor():
    """llm-compressor's `oneshot`, imported beside transformers 5.19.

    llmcompressor 0.12 imports `GraniteMoeParallelExperts`, which transformers 5.19 removed; it
    uses it only to recognise Granite MoE layers, so a placeholder class (that no model has)
    lets everything else import.
    """
    try:
        import transformers.models.granitemoe.modeling_granitemoe as granitemoe

        if not hasattr(granitemoe, "GraniteMoeParallelExperts"):
            granitemoe.GraniteMoeParallelExperts = type("GraniteMoeParallelExperts", (), {})
        from llmcompressor import oneshot
    except ImportError as exc:
        raise LlmoptError(f"llm-compressor is not importable ({exc})", "run `bash scripts/install.sh`") from None
    return oneshot


def _dataset(windows: list[list[int]]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})


class _LayerProgress:
    """Reports progress from forward calls of the decoder layers: calibrating runs every sample
    through every layer `passes` times (capture, then propagate the quantized outputs)."""

    def __init__(self, model: Any, progress: Callable[[float], None], passes: int, samples: int) -> None:
        self.layers = list(getattr(getattr(model, "model", model), "layers", []))
        self.progress, self.total = progress, max(passes * samples * len(self.layers), 1)
        self.calls, self.handles = 0, []

    def _hook(self, *_: Any) -> None:
        self.calls += 1
        if self.calls % 8 == 0:
            self.progress(0.05 + 0.85 * min(self.calls / self.total, 1.0))

    def __enter__(self) -> "_LayerProgress":
        self.handles = [layer.register_forward_hook(self._hook) for layer in self.layers]
        return self

    def __exit__(self, *_: Any) -> None:
        for handle in self.handles:
            handle.remove()


def _copy_non_weight_files(source: Path, dest: Path) -> None:
    """Tokenizer, chat template and generation config: everything but the weights and config."""
    for path in source.iterdir():
        if path.is_file() and path.suffix not in (".safetensors", ".bin") and path.name not in (
            "config.json", "model.safetensors.index.json"
        ):
            shutil.copyfile(path, dest / path.name)


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))

"""Quantization: llm-compressor's oneshot over the source weights, written as a compressed-tensors
checkpoint that vLLM loads as it is, and held to a quality budget against the source.

llm-compressor runs in the job's worker process (one environment with vLLM; see docs/quantization.md,
"Why one environment", for why). It is imported lazily: only quantizing jobs pay for it.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from pydantic import BaseModel

from llmopt import hashing, paths, procs, roofline
from llmopt.engine import platform
from llmopt.errors import LlmoptError
from llmopt.sources import Model
from llmopt.techniques.base import BuildContext, CheckContext, Step, Technique
from llmopt.techniques.quantization import calibration, schemes
from llmopt.techniques.quantization.calibration import CalibrationRecord
from llmopt.techniques.quantization.schemes import Quantization

KEPT_RECORD = "quantization.json"
RUNTIME_BYTES = 1.5e9  # torch, transformers and llm-compressor imported, before any model
ACTIVATION_COPIES = 12  # hidden-state copies per calibrated token (layer inputs, outputs, AWQ's cached args)


def calibration_dtype(hw: platform.Hardware) -> str:
    """What a model is loaded, calibrated and quantized in: bf16, except where this machine serves
    float32 (x86 without AVX-512, `platform.default_dtype`), whose bf16 matmuls run at 1-10 GFLOP/s
    (the built-in SmoothQuant over SmolLM2-135M took 319 s in bf16 and 100 s in float32 on a Zen 3
    EPYC, benchmarks/calibration_dtype.py). Weights rounded from float32 differ from those rounded
    from bf16, so the dtype is in their keys there."""
    return platform.default_dtype(hw)


def _dtype_key(dtype: str) -> dict[str, str]:
    """The calibration dtype for a key: nothing for bf16, so keys made before it counted stay."""
    return {} if dtype == "bfloat16" else {"dtype": dtype}


def estimate_peak_bytes(q: Quantization, config: dict, weight_bytes: int, dtype: str = "bfloat16") -> int:
    """What quantizing needs at its peak: the model in `dtype` (from 16-bit weights on disk), its
    compressed copy while saving, the calibration activations the sequential pipeline keeps for
    every sample, and the largest per-layer GPTQ Hessian. An upper bound from the requested
    calibration size."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    width = roofline.FLOAT_BYTES[dtype]
    estimate = RUNTIME_BYTES + 3 * weight_bytes * width // 2
    if schemes.needs_calibration(q):
        cal = q.calibration  # type: ignore[union-attr]
        estimate += cal.samples * cal.sequence_length * hidden * width * ACTIVATION_COPIES
        estimate += heads * cal.sequence_length**2 * 4 * 2  # one sample's attention scores, fp32, forward and softmax
        estimate += sum(4 * w * w for w in schemes.LayerShapes.from_config(config).inputs) * 3
    return int(estimate)


def check_memory(q: Quantization, config: dict, weight_bytes: int, dtype: str = "bfloat16") -> str | None:
    """A refusal when the estimate exceeds the memory available now, else None."""
    needed = estimate_peak_bytes(q, config, weight_bytes, dtype)
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


class QuantizationRecord(BaseModel):
    """What the manifest records about a quantized model (the recipe's target, or a draft)."""

    scheme: Quantization
    calibration: CalibrationRecord | None = None
    group_size: int | None = None  # as fitted to the layer shapes
    block_size: tuple[int, int] | None = None
    fit_note: str | None = None
    seconds: float
    peak_rss_bytes: int
    estimated_peak_bytes: int  # as the compatibility check saw it
    size_bytes: int
    source_size_bytes: int
    seed: int = schemes.SEED  # torch's, Python's and NumPy's, set before quantizing; calibration runs in order
    dtype: str = "bfloat16"  # what the model was loaded, calibrated and quantized in (`calibration_dtype`)
    reused: bool = False  # linked from weights an earlier job quantized the same way (figures are that job's)

    @property
    def method(self) -> str:
        return self.scheme.method


class QuantizationTechnique(Technique):
    section = "quantization"
    spec = Quantization
    metrics = QuantizationRecord

    def names(self, spec: Quantization) -> list[str]:
        return [schemes.name(spec)]

    def check_inputs(self, spec: Quantization) -> None:
        if schemes.needs_calibration(spec):
            try:
                calibration.check(spec.calibration)  # type: ignore[union-attr]
            except LlmoptError as exc:
                raise LlmoptError(f"calibration: {exc.problem}", exc.fix) from None

    def check(self, spec: Quantization, ctx: CheckContext) -> None:
        """Not already quantized; the group or block size fits the layer shapes; it fits in memory."""
        already = ctx.config.get("quantization_config")
        if already:
            ctx.verdict.refusals.append(
                f"'{ctx.target.id}' is already quantized ({already.get('quant_method', 'unknown method')}); "
                "quantize the model it was made from instead"
            )
            return
        try:
            fitted = schemes.fit(spec, ctx.config, ctx.engine.tensor_parallel_size)
        except LlmoptError as exc:
            ctx.verdict.refusals.append(f"{exc.problem}; {exc.fix}")
            return
        if fitted.note:
            ctx.verdict.warnings.append(fitted.note)
        try:
            self.check_inputs(spec)
        except LlmoptError as exc:
            ctx.verdict.refusals.append(f"{exc.problem}; {exc.fix}")
        refusal = check_memory(spec, ctx.config, ctx.target.size_bytes, calibration_dtype(ctx.hardware))
        if refusal:
            ctx.verdict.refusals.append(refusal)

    def peak_bytes(self, spec: Quantization, ctx: CheckContext) -> int:
        return estimate_peak_bytes(spec, ctx.config, ctx.target.size_bytes, calibration_dtype(ctx.hardware))

    def key(self, spec: Quantization, source: Model, hardware: platform.Hardware) -> dict[str, Any]:
        """The calibration text (the built-in set changes between versions, a user's file may change)
        and the dtype quantizing runs in on the machine."""
        calibrated = {"calibration": calibration.fingerprint(spec.calibration)} if schemes.needs_calibration(spec) else {}  # type: ignore[union-attr]
        return {**calibrated, **_dtype_key(calibration_dtype(hardware))}

    def steps(self, spec: Quantization) -> list[Step]:
        return [Step("quantize", self._apply, writes_weights=True)]

    def _apply(self, ctx: BuildContext) -> None:
        q = ctx.recipe.quantization
        ctx.metrics[self.section] = quantize_model(q, ctx.source, ctx.workdir, ctx.engine.tensor_parallel_size, ctx.log,
                                                   ctx.progress)

    def changes_numerics(self, spec: Quantization) -> bool:
        return True

    def judge(self, spec: Quantization, ctx: BuildContext, perplexity_increase: float, base: Any) -> None:
        if perplexity_increase > spec.max_perplexity_increase:
            raise LlmoptError(
                f"quality budget exceeded: perplexity rose {100 * perplexity_increase:.1f}% ({base.perplexity:.2f} -> "
                f"{base.perplexity * (1 + perplexity_increase):.2f} on {base.tokens} held-out tokens), over "
                f"quantization.max_perplexity_increase {spec.max_perplexity_increase:g} for {spec.method}",
                "raise the budget, or calibrate on more data, or use a smaller group_size (awq) or another scheme",
            )


TECHNIQUE = QuantizationTechnique()


# What llmopt itself changes in a checkpoint after llm-compressor writes it; bumped when that
# changes, so weights kept under the old key are not linked into new artifacts
# (2: a quantized lm_head named in the config groups, see _name_lm_head)
CHECKPOINT_FORMAT = 2


def kept_weights(q: Quantization, source_model: Model, tensor_parallel: int, dtype: str) -> Path:
    """Where weights quantized this way are kept: keyed by all that makes them."""
    key = hashing.json_sha256({**_dtype_key(dtype),
        "source": source_model.content_hash, "tensor_parallel": tensor_parallel,
        # the quality budget judges the weights, it does not make them: a retry with a raised one links them
        "scheme": q.model_dump(mode="json", exclude={"max_perplexity_increase"}),
        "calibration": calibration.fingerprint(q.calibration) if schemes.needs_calibration(q) else None,  # type: ignore[union-attr]
        "llmcompressor": _version("llmcompressor"), "compressed_tensors": _version("compressed-tensors"),
        "checkpoint": CHECKPOINT_FORMAT,
    })
    return paths.home() / "quantized" / key


def quantize_model(q: Quantization, source_model: Model, dest: Path, tensor_parallel: int,
                   log: logging.Logger, progress: Callable[[float], None]) -> QuantizationRecord:
    """Quantize a model folder into `dest` as a compressed-tensors checkpoint; returns what the
    manifest records about it. The target of a recipe and a draft model both go through here.

    Quantizing is deterministic, so weights once made for a source, scheme, calibration text and
    sharding are kept (`$LLMOPT_HOME/quantized/<key>/`, hard-linked where it can be) and linked
    into the next artifact that asks for the same: stacking speculation or another engine setting
    on a quantized model does not quantize again."""
    dtype = calibration_dtype(platform.detect())
    kept = kept_weights(q, source_model, tensor_parallel, dtype)
    if (kept / KEPT_RECORD).is_file():
        _link_tree(kept, dest)
        # the figures are the earlier job's; the scheme is this recipe's (its budget may differ)
        record = QuantizationRecord.model_validate_json((kept / KEPT_RECORD).read_text()).model_copy(update={"reused": True, "scheme": q})
        log.info("reusing %s weights quantized earlier for %s (%s)", q.method, source_model.id, kept)
        progress(1.0)
        return record
    record = _quantize(q, source_model, dest, tensor_parallel, dtype, log, progress)
    _keep(dest, kept, record)
    return record


def _quantize(q: Quantization, source_model: Model, dest: Path, tensor_parallel: int, dtype: str,
              log: logging.Logger, progress: Callable[[float], None]) -> QuantizationRecord:
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
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    kwargs: dict[str, Any] = {}
    described = None
    if schemes.needs_calibration(q):
        cal = calibration.build(q.calibration, tokenizer)  # type: ignore[union-attr]
        described = cal.description
        log.info("calibration: %s", described.model_dump())
        # in order: llm-compressor shuffles with torch's unseeded RNG by default, and GPTQ's Hessian sums
        # then run in another order each time, so two runs gave different weights (+0.70% and +1.64% perplexity)
        kwargs.update(dataset=_dataset(cal.windows), num_calibration_samples=len(cal.windows),
                      max_seq_length=described.sequence_length, shuffle_calibration_samples=False)

    _seed(schemes.SEED)
    progress(0.05)
    with _LayerProgress(model, progress, passes=2 if schemes.needs_calibration(q) else 0,
                        samples=kwargs.get("num_calibration_samples", 0)):
        oneshot(model=model, recipe=schemes.modifiers(q, fitted), tokenizer=tokenizer, **kwargs)
    progress(0.9)
    if dtype != "bfloat16":
        _unquantized_to_bf16(model)
    _copy_non_weight_files(source, dest)
    model.save_pretrained(dest, save_compressed=True)
    if "lm_head.weight_scale" in roofline.tensors(dest):  # as written, whatever `ignore` spelled
        _name_lm_head(dest / "config.json")
    tokenizer.save_pretrained(dest)
    (dest / "recipe.yaml").unlink(missing_ok=True)  # llm-compressor's own; the manifest has ours

    record = QuantizationRecord(
        scheme=q, calibration=described, group_size=fitted.group_size, block_size=fitted.block_size, fit_note=fitted.note,
        seconds=round(time.monotonic() - started, 1), peak_rss_bytes=procs.peak_rss_bytes(),
        estimated_peak_bytes=estimate_peak_bytes(q, config, source_model.size_bytes, dtype), size_bytes=_weight_bytes(dest),
        source_size_bytes=_weight_bytes(source), dtype=dtype,
    )
    log.info("quantized %s (%s) in %.0f s; weights %.0f MB -> %.0f MB; peak memory %.2f GiB", source_model.id,
             q.method, record.seconds, record.source_size_bytes / 1e6, record.size_bytes / 1e6, record.peak_rss_bytes / 2**30)
    progress(1.0)
    return record


def _unquantized_to_bf16(model: Any) -> None:
    """Quantized in float32, the layers left unquantized (embeddings, norms, an ignored lm_head) are
    stored in bf16, as quantizing in bf16 stores them, not in twice the bytes: the checkpoint then
    takes no more room, nor streams more bytes where it is served in bf16. The quantized layers
    keep float32 until saving rounds them to int8 (their scales stay float32)."""
    import torch

    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            for param in module.parameters(recurse=False):
                param.data = param.data.to(torch.bfloat16)


def _name_lm_head(config_file: Path) -> None:
    """A quantized lm_head must be named in the checkpoint's config groups: compressed-tensors
    writes the class name "Linear", which vLLM matches to its own linear layers only, and vLLM's
    lm_head is a ParallelLMHead (it would then look for bf16 weights and find INT8 ones)."""
    config = json.loads(config_file.read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = [*group["targets"], "lm_head"]
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _version(distribution: str) -> str | None:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


def _link_tree(source: Path, dest: Path) -> None:
    """Every file of `source` (but its record) into `dest`: hard links on one file system, copies across."""
    for path in source.rglob("*"):
        if path.is_file() and path.name != KEPT_RECORD:
            target = dest / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copyfile(path, target)


def _keep(dest: Path, kept: Path, record: QuantizationRecord) -> None:
    """Keep a copy of freshly quantized weights under their key, made whole before it is named."""
    staging = kept.parent / f".new-{kept.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    _link_tree(dest, staging)
    (staging / KEPT_RECORD).write_text(record.model_dump_json())
    try:
        staging.rename(kept)
    except OSError:  # another job kept the same weights first
        shutil.rmtree(staging, ignore_errors=True)


def _seed(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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

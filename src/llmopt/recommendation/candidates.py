"""Which recipes a recommendation tries for a model on this machine, and what each will cost in time.

Candidates come from the compatibility matrix for this model, hardware and processor: the model as
it is, each quantization scheme the matrix marks as fast here, the catalogue's speculation for the
model (n-gram or its recommended draft, with its quantization), the best quantization stacked with
speculation (for SmoothQuant also with its lm_head in INT8, at its own quality cost), a smaller
chunked-prefill budget on the quantized model, and an FP8 KV cache where the cache bounds how many
sequences fit. What the matrix refuses or marks slow here is left out, with
the reason. Speculative candidates speculate at every batch size: the recommendation's own
equal-work measurement at each level says where speculation pays, so no job sweeps for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, computed_field

from llmopt import catalog, compatibility, recipe, roofline
from llmopt.engine.config import EngineConfig
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError
from llmopt.sources import Model
from llmopt.techniques import quantization, speculative

SCHEMES = ("smoothquant", "awq", "fp8")  # in order of preference where several are fast: quality cost first
CHUNK_BUDGET = 256  # tokens per step: steadier decoding while other requests' prompts are prefilled
KV_BYTES_PER_ELEMENT = 2  # bf16 cache
INT8_HEAD_SCHEMES = ("smoothquant",)  # where an INT8 lm_head (`ignore: []`) is tested end to end
QUANTIZED_LINEAR_COST = 0.5  # a quantized linear layer's time against bf16's (`_weights_cost`)


class Candidate(BaseModel):
    name: str
    recipe: dict[str, Any]
    base_s: float  # its time without quantizing (`estimate_seconds`)
    quantize_s: float = 0.0  # making its quantized weights: 0 without quantization, or where they are kept already
    weights: str | None = None  # those weights' key (`quantization.kept_weights`): who shares them
    pays_quantizing: bool = False  # whether this run's quantizing of `weights` falls to it (`share_quantizing`)
    scale: float = 1.0  # this machine's past candidates' times over their estimates (`calibration.scale`)
    status: str = "pending"  # pending | done | failed | dropped
    reason: str | None = None  # why it failed, or was dropped
    job: str | None = None
    artifact: str | None = None
    seconds: float | None = None  # what it took

    @computed_field  # type: ignore[prop-decorator]
    @property
    def estimate_s(self) -> float:
        """Its time in this run: what the budget weighs and the table shows."""
        return self.scale * (self.base_s + (self.quantize_s if self.pays_quantizing else 0.0))


class Excluded(BaseModel):
    technique: str
    reason: str


def build(source: Model, hardware: Hardware, concurrency: tuple[int, ...], extra: list[str]) -> tuple[list[dict], list[Excluded]]:
    """Candidate recipes (named, as data) and the techniques left out here, with why."""
    config = _config(source)
    architecture = source.architecture or "unknown"
    excluded: list[Excluded] = []

    def fast_here(technique: str) -> bool:
        verdict = compatibility.Verdict()
        row = compatibility.apply(technique, architecture, hardware, verdict)
        if row is None or row.status != "supported":
            excluded.append(Excluded(technique=technique, reason=(verdict.refusals + verdict.warnings + ["not supported here"])[0]))
            return False
        return True

    found: list[dict] = [{"name": "bf16"}]
    schemes = [s for s in SCHEMES if fast_here(f"quantization.{s}" + (".block" if s == "fp8" else ""))]
    for scheme in schemes:
        found.append({"name": scheme, "quantization": {"method": scheme}})
    spec = _speculation(source)
    if spec is not None and fast_here(f"speculative.{spec['method']}"):
        label = "ngram" if spec["method"] == "ngram" else "draft"
        found.append({"name": label, "speculative": spec})
        if schemes:
            found.append({"name": f"{schemes[0]}-{label}", "quantization": {"method": schemes[0]}, "speculative": spec})
            if spec["method"] == "ngram":  # a shorter guess: cheaper to verify where fewer drafts are accepted
                found.append({"name": f"{schemes[0]}-{label}-k2", "quantization": {"method": schemes[0]},
                              "speculative": {**spec, "num_speculative_tokens": 2}})
            if schemes[0] in INT8_HEAD_SCHEMES:  # every decoded token reads the whole lm_head: in INT8, half the bytes
                found.append({"name": f"{schemes[0]}-int8-head-{label}", "quantization": {"method": schemes[0], "ignore": []},
                              "speculative": spec})
    if schemes and fast_here("chunked_prefill"):
        found.append({"name": f"{schemes[0]}-chunk{CHUNK_BUDGET}", "quantization": {"method": schemes[0]},
                      "chunked_prefill": {"max_num_batched_tokens": CHUNK_BUDGET}})
    if _cache_bounds_concurrency(config, max(concurrency)) and fast_here("kv_cache.fp8"):
        found.append({"name": "kv-fp8", "kv_cache": {"dtype": "fp8"}})
    for path in extra:
        loaded = recipe.load(path)
        found.append({**loaded.to_dict(), "name": Path(path).stem})
    return found, excluded


def _config(source: Model) -> dict:
    return json.loads((Path(source.path) / "config.json").read_text())


def _speculation(source: Model) -> dict | None:
    """The catalogue's speculation for a catalogued model; n-gram for any other."""
    catalogued = speculative.catalog_id(source)
    method = "ngram" if catalogued is None or catalog.get(catalogued).recommended_draft == "ngram" else "draft_model"
    return {"method": method, "disable_above_batch": "never"}


def _cache_bounds_concurrency(config: dict, concurrency: int, context_tokens: int = 4096) -> bool:
    """Whether the default KV cache holds fewer than `concurrency` full-length sequences."""
    heads = config.get("num_key_value_heads", config.get("num_attention_heads", 1))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * KV_BYTES_PER_ELEMENT
    return EngineConfig().kv_cache_gib * 2**30 // per_token < concurrency * context_tokens


def estimate_seconds(candidate: dict, source: Model, hardware: Hardware, level_requests: dict[int, int],
                     min_level_s: float) -> float:
    """A candidate's time on this machine from the model's size, quantizing apart (`quantizing`):
    the job's measuring engine and the evaluation's (compiled once, then from the compile cache),
    and the load at every level: its requests, at about 0.5 s plus 2.5 s per gigabyte of weights
    each on two cores (a QA request on SmolLM2-135M took about 1 s alone, on the 1.5B about 8),
    quantized weights counted at what they cost (`_weights_cost`), served c at a time about c**0.4
    times as fast (prefills batch poorly on a CPU). Rough, for choosing what fits a budget."""
    gigabytes = source.size_bytes / 1e9
    slowdown = 2 / max(hardware.cores, 1)
    cold_start, warm_start = 60 + 40 * gigabytes, 30 + 20 * gigabytes
    request_s = (0.5 + 2.5 * gigabytes * _weights_cost(candidate, source)) * slowdown
    load = sum(max(min_level_s, n * request_s / c ** 0.4) for c, n in level_requests.items())
    seconds = cold_start * slowdown + warm_start + load
    if candidate["name"] == "bf16":  # the reference's natural lengths: one pass at the highest level
        seconds += max(level_requests.values()) * request_s / max(level_requests) ** 0.4
    return round(seconds, 0)


def _weights_cost(candidate: dict, source: Model) -> float:
    """What a candidate's weights cost a request, against the source's. Quantized, the linear layers
    cost half theirs: SmoothQuant's 8-bit weights are half the bytes a token reads, and INT8
    multiplies at about twice bf16's rate; the lm_head, left in bf16 unless the recipe's `ignore`
    leaves it out, costs all of its own. So SmoothQuant's load took 0.6-0.9x bf16's in the saved
    recommendation runs (AWQ and FP8, offered only where the matrix marks them fast, are counted
    alike, unmeasured). A model whose size this cannot read (no safetensors, no vocabulary or
    hidden size in its config) is counted at the source's cost."""
    if not candidate.get("quantization"):
        return 1.0
    config = _config(source)
    lm_head = config.get("vocab_size", 0) * config.get("hidden_size", 0)
    traffic = roofline.traffic(Path(source.path))
    read = traffic.macs_bf16 + traffic.macs_int8  # the weights a token reads, one multiply-add each
    if not lm_head or not read:
        return 1.0
    parsed = recipe.parse({k: v for k, v in candidate.items() if k != "name"})
    quantized = read if "lm_head" not in parsed.quantization.ignore else max(0, read - lm_head)
    return 1 - (1 - QUANTIZED_LINEAR_COST) * quantized / read


def quantizing(candidate: dict, source: Model, hardware: Hardware) -> tuple[float, str | None]:
    """The seconds quantizing this candidate's weights takes with llm-compressor on the CPU (0 where
    weights made the same way are kept: the job links them), and those weights' key (None without
    quantization), which candidates that quantize alike share."""
    if not candidate.get("quantization"):
        return 0.0, None
    parsed = recipe.parse({k: v for k, v in candidate.items() if k != "name"})
    kept = quantization.kept_weights(parsed.quantization, source, parsed.tensor_parallel_size, quantization.calibration_dtype(hardware))
    if (kept / quantization.KEPT_RECORD).is_file():
        return 0.0, kept.name
    per_gigabyte = {"smoothquant": 330, "awq": 1000, "fp8": 20}.get(parsed.quantization.method, 330)
    return round(per_gigabyte * source.size_bytes / 1e9 * 2 / max(hardware.cores, 1), 0), kept.name


def share_quantizing(candidates: list[Candidate], first: str) -> None:
    """Weights quantized once are linked into every later artifact that asks for the same (the
    job's `kept_weights`), so of the candidates that quantize alike, only the first in run order
    (`first` runs first, then the list's order) that is pending or done pays for quantizing. A
    dropped one hands it on, and so does a failed one: it may have failed before its weights were
    kept, and where they were kept, those still to run find them (`refresh_quantizing`) and pay nothing."""
    paid: set[str] = set()
    for candidate in sorted(candidates, key=lambda c: c.name != first):
        pays = candidate.quantize_s > 0 and candidate.status in ("pending", "done") and candidate.weights not in paid
        if pays and candidate.weights:
            paid.add(candidate.weights)
        if candidate.status == "pending":  # what ran keeps its estimate, and a dropped one the estimate that dropped it
            candidate.pays_quantizing = pays


def refresh_quantizing(candidates: list[Candidate], source: Model, hardware: Hardware) -> None:
    """A stopped run's candidates still to run quantize as things stand now: weights another run or
    job has kept since are linked, not quantized. A dropped candidate whose weights one of this run's
    candidates ran with (done, or failed after keeping them) keeps the estimate it was dropped with,
    so that the resumed run's budget drops the same candidates. A recipe that no longer parses keeps
    its saved estimate too, and fails when it runs."""
    ran_with = {c.weights for c in candidates if c.status in ("done", "failed") and c.weights}
    for candidate in candidates:
        if candidate.status == "pending" or (candidate.status == "dropped" and candidate.weights not in ran_with):
            try:
                candidate.quantize_s, candidate.weights = quantizing({"name": candidate.name, **candidate.recipe}, source, hardware)
            except LlmoptError:
                continue

"""Recipes as data: round trips, validation messages, flags merging, and the matrix's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt import AWQ, FP8, ChunkedPrefill, Compilation, DraftModel, KVCache, NGram, Recipe, Sharding, SmoothQuant, SpeculationSweep
from llmopt import compatibility, recipe, techniques
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError

CPU = Hardware(device="cpu", cpu_model="test", cores=2, memory_gib=24, cpu_flags=(), gpu=None, gpu_count=0)

FULL = Recipe(
    quantization=AWQ(group_size=64, symmetric=True),
    kv_cache=KVCache(dtype="fp8"),
    speculative=DraftModel("qwen2.5-coder-0.5b-instruct", num_speculative_tokens=4),
    compilation=Compilation(max_num_seqs=8),
    sharding=Sharding(tensor_parallel_size=1),
    chunked_prefill=ChunkedPrefill(max_num_batched_tokens=256),
)


@pytest.mark.parametrize("value", [FULL, Recipe(), Recipe(quantization=SmoothQuant(alpha=0.5)), Recipe(quantization=FP8(scheme="dynamic")), Recipe(speculative=NGram(prompt_lookup_max=6)),
    Recipe(speculative=NGram(disable_above_batch="never")), Recipe(speculative=DraftModel("d", quantization=SmoothQuant(alpha=0.6))), Recipe(speculative=NGram(disable_above_batch=4, sweep=SpeculationSweep(concurrency=(1, 16))))])
def test_round_trip_yaml_and_json(value: Recipe, tmp_path: Path) -> None:
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"r{suffix}"
        recipe.save(value, path)
        assert recipe.load(str(path)) == value


def test_builtins_parse_and_name_their_techniques() -> None:
    assert recipe.load("baseline").techniques() == []
    assert recipe.load("ngram").techniques() == ["speculative.ngram"]
    assert recipe.load("fp8-block").techniques() == ["quantization.fp8.block"]
    assert FULL.techniques() == ["quantization.awq", "kv_cache.fp8", "speculative.draft_model", "compilation", "chunked_prefill"]


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(LlmoptError) as info:
        recipe.parse({"quantization": {"method": "awq", "groupsize": 64}})
    assert "unknown key 'groupsize'" in str(info.value) and "group_size" in str(info.value)
    with pytest.raises(LlmoptError, match="valid keys: chunked_prefill, compilation, kv_cache, name, quantization, sharding, speculative"):
        recipe.parse({"quantisation": {}})
    with pytest.raises(LlmoptError, match="unknown key 'bits' in speculative.draft_model.quantization.smoothquant; valid keys: alpha"):
        recipe.parse({"speculative": {"method": "draft_model", "quantization": {"method": "smoothquant", "bits": 8}}})


def test_unknown_values_list_valid_values() -> None:
    with pytest.raises(LlmoptError, match="'awq', 'smoothquant', 'fp8'"):
        recipe.parse({"quantization": {"method": "gguf"}})
    with pytest.raises(LlmoptError, match="'auto', 'fp8' or 'fp8_e5m2'"):
        recipe.parse({"kv_cache": {"dtype": "int2"}})


def test_contradictions_are_refused() -> None:
    with pytest.raises(LlmoptError, match="prompt_lookup_min"):
        recipe.parse({"speculative": {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}})
    with pytest.raises(LlmoptError, match="num_speculative_tokens must be smaller"):
        recipe.parse({"speculative": {"method": "ngram", "num_speculative_tokens": 8}, "compilation": {"max_model_len": 8}})
    with pytest.raises(LlmoptError, match="increasing positive integers"):
        recipe.parse({"speculative": {"method": "ngram", "sweep": {"concurrency": [4, 1]}}})
    with pytest.raises(LlmoptError, match="disable_above_batch must be positive"):
        recipe.parse({"speculative": {"method": "ngram", "disable_above_batch": 0}})
    with pytest.raises(LlmoptError, match=r"max_num_batched_tokens \(32\) is smaller than max_num_seqs \(64\)"):
        recipe.parse({"compilation": {"max_num_seqs": 64}, "chunked_prefill": {"max_num_batched_tokens": 32}})


def test_flags_replace_sections_and_drop_the_name(tmp_path: Path) -> None:
    base = recipe.load("ngram")
    merged = base.merged(recipe.flag_overrides(kv_cache="fp8", speculative="draft=my-draft"))
    assert merged.name is None
    assert merged.kv_cache == KVCache(dtype="fp8")
    assert merged.speculative == DraftModel("my-draft")
    with pytest.raises(LlmoptError, match="unknown --speculative"):
        recipe.flag_overrides(speculative="eagle9")


def test_bad_recipe_file_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("quantization: [unclosed")
    with pytest.raises(LlmoptError, match="cannot parse"):
        recipe.load(str(bad))
    with pytest.raises(LlmoptError, match="no recipe file or built-in recipe named 'nope'"):
        recipe.load("nope")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9".encode("latin-1"))
    with pytest.raises(LlmoptError, match="not UTF-8"):
        recipe.load(str(latin1))


def test_matrix_file_is_complete() -> None:
    """Every technique a recipe can name has a row, so nothing falls through unchecked."""
    named = {row.technique for row in compatibility.matrix()}
    every = set(FULL.techniques()) | {"quantization.smoothquant", "quantization.fp8.block", "quantization.fp8.dynamic",
                                      "kv_cache.fp8_e5m2", "speculative.ngram", "sharding.tensor_parallel"}
    assert every <= named
    assert all(row.status in ("supported", "slow", "refused", "unavailable") for row in compatibility.matrix())


def test_a_recipe_has_a_section_per_registered_technique() -> None:
    assert set(Recipe.model_fields) == {"name", *(t.section for t in techniques.REGISTRY)}
    engine = techniques.engine(FULL)
    assert engine.kv_cache_dtype == "fp8" and engine.max_num_seqs == 8 and engine.max_num_batched_tokens == 256
    assert engine.speculative is not None and engine.speculative.model == "./draft" and engine.speculative.num_speculative_tokens == 4


@pytest.mark.parametrize("technique, flags, status", [
    ("quantization.awq", ("avx512f", "amx_int8", "amx_bf16", "amx_tile"), "supported"),
    ("quantization.awq", ("avx512f",), "slow"),  # no faster than bf16 without AMX (an AMD EPYC)
    ("quantization.awq", ("avx", "avx2"), "refused"),  # vLLM's AVX2 build has no W4A16 kernel
    ("quantization.smoothquant", ("avx512f", "avx512_vnni"), "supported"),
    ("quantization.smoothquant", ("avx2", "avx_vnni"), "supported"),
    ("quantization.smoothquant", ("avx512f", "amx_int8", "amx_tile"), "supported"),
    ("quantization.smoothquant", ("avx", "avx2"), "supported"),  # llmopt's AVX2 W8A8 kernel, no VNNI needed
    ("quantization.smoothquant", ("avx2", "avx512f"), "slow"),  # AVX-512 without VNNI: oneDNN's saturating int8
    ("kv_cache.fp8", ("avx2", "avx512f"), "supported"),
    ("kv_cache.fp8", ("avx", "avx2"), "refused"),  # vLLM keeps an FP8 cache only with AVX-512 or AMX
    ("kv_cache.fp8_e5m2", ("avx2", "avx512f"), "slow"),
    ("kv_cache.fp8_e5m2", ("avx", "avx2"), "refused"),
])
def test_matrix_rows_follow_the_processor(technique: str, flags: tuple, status: str) -> None:
    cpu = CPU.model_copy(update={"cpu_flags": flags})
    verdict = compatibility.Verdict()
    row = compatibility.apply(technique, "LlamaForCausalLM", cpu, verdict)
    assert (row.status if row else "refused") == status
    assert bool(verdict.warnings) == (status == "slow") and bool(verdict.refusals) == (status == "refused")

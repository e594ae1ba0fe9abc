"""The GPU path of the engine layer, on a described GPU machine (no GPU, no engine here): the flags,
environment and engine arguments rendered for it, the compile-cache key, and the sharding check
that counts its GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmopt import recipe as recipes
from llmopt import sources, techniques
from llmopt.engine import compile_cache, platform, vllm
from llmopt.engine.config import CompilationConfig, EngineConfig
from llmopt.errors import LlmoptError

H100 = platform.Hardware(device="cuda", cpu_model="Intel Xeon Platinum 8480+", cores=52, memory_gib=2015.6,
                         cpu_flags=("amx_bf16", "avx512f"), gpu="NVIDIA H100 80GB HBM3", gpu_count=2)
L4 = H100.model_copy(update={"gpu": "NVIDIA L4"})
EPYC = platform.Hardware(device="cpu", cpu_model="AMD EPYC 9R14", cores=2, memory_gib=24, cpu_flags=("avx512f",), gpu=None)
SHARDED = EngineConfig(tensor_parallel_size=2, kv_cache_dtype="fp8", gpu_memory_utilization=0.85)


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_gpu_flags_for_tensor_parallelism_two() -> None:
    argv = vllm.flags(SHARDED, "m", hw=H100)
    assert _value(argv, "--tensor-parallel-size") == "2"
    assert _value(argv, "--gpu-memory-utilization") == "0.85"
    assert _value(argv, "--kv-cache-dtype") == "fp8"
    assert vllm.engine_kwargs(SHARDED, H100) == {"dtype": "bfloat16", "max_model_len": 4096, "seed": 0, "kv_cache_dtype": "fp8",
                                                 "gpu_memory_utilization": 0.85, "tensor_parallel_size": 2}


def test_gpu_memory_utilization_only_on_a_gpu_and_only_when_set() -> None:
    one_device = SHARDED.model_copy(update={"tensor_parallel_size": 1})
    assert "--gpu-memory-utilization" not in vllm.flags(one_device, "m", hw=EPYC)  # the CPU's KV cache is sized in GiB
    assert "gpu_memory_utilization" not in vllm.engine_kwargs(one_device, EPYC)
    assert "--gpu-memory-utilization" not in vllm.flags(EngineConfig(tensor_parallel_size=2), "m", hw=H100)  # vLLM's default


def test_the_serving_machine_is_asked_only_when_a_gpu_setting_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Callers that do not describe the machine (deploy, the measure step) get the one they run on."""
    def no_detection() -> platform.Hardware:
        raise AssertionError("detected the machine for settings that do not depend on it")

    monkeypatch.setattr(platform, "detect", no_detection)
    python = CompilationConfig(wrapper="python")  # and the dtype given: unset, it is the machine's choice
    assert vllm.server_argv("/m", EngineConfig(tensor_parallel_size=2, compilation=python, dtype="bfloat16"), "m", "127.0.0.1", 8000)
    monkeypatch.setattr(platform, "detect", lambda: H100)
    assert _value(vllm.server_argv("/m", SHARDED, "m", "127.0.0.1", 8000), "--gpu-memory-utilization") == "0.85"
    # how the compiled graph calls its kernels follows the device when unset
    assert _value(vllm.server_argv("/m", SHARDED, "m", "127.0.0.1", 8000), "--compilation-config") is None
    monkeypatch.setattr(platform, "detect", lambda: EPYC)
    assert json.loads(_value(vllm.server_argv("/m", SHARDED, "m", "127.0.0.1", 8000), "--compilation-config") or "null") == {
        "inductor_compile_config": {"cpp_wrapper": True}}


def test_the_cpp_graph_wrapper_on_a_gpu_is_refused() -> None:
    cpp = EngineConfig(compilation=CompilationConfig(wrapper="cpp"))
    with pytest.raises(LlmoptError, match="wrapper 'cpp' is for CPUs, and this machine serves on NVIDIA H100 80GB HBM3 -- leave compilation.wrapper unset"):
        vllm.flags(cpp, "m", hw=H100)
    assert vllm.graph_wrapper(EngineConfig(), H100) == "python"


def test_the_whole_graph_on_a_gpu_is_refused() -> None:
    """vLLM compiles piecewise on a GPU, where it replays CUDA graphs of the pieces."""
    with pytest.raises(LlmoptError, match="graph 'whole' is for CPUs, and this machine serves on NVIDIA H100 80GB HBM3 -- leave compilation.graph unset"):
        vllm.compiled_graph(EngineConfig(compilation=CompilationConfig(graph="whole")), H100)
    assert vllm.compiled_graph(EngineConfig(), H100) == "piecewise"


@pytest.mark.parametrize("settings", [SHARDED, EngineConfig(reserved_cpus=1, executor="uni", preload=True, kv_cache_gib=8)])
def test_no_cpu_environment_on_a_gpu(settings: EngineConfig) -> None:
    """No VLLM_CPU_*, no preloaded tcmalloc or Intel OpenMP, no OpenMP threads: even settings that ask
    for them on CPU."""
    assert vllm.environment(settings, H100) == {}
    assert vllm.image_environment(settings, H100) == {}
    one_device = settings.model_copy(update={"tensor_parallel_size": 1})
    assert "VLLM_CPU_KVCACHE_SPACE" in vllm.environment(one_device, EPYC)  # where they do apply


def test_the_gpu_kind_keys_the_compile_cache(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576}))

    def key(hw: platform.Hardware, settings: EngineConfig = SHARDED) -> str:
        return compile_cache.key_of(compile_cache.components(tmp_path, settings, hw, ("vllm", "0.32.0"), "2.13.0"))

    assert key(H100) != key(L4)
    assert key(H100) != key(EPYC)
    assert key(H100) != key(H100, SHARDED.model_copy(update={"tensor_parallel_size": 1}))
    # how much memory it may take, and how many GPUs the machine has beyond those it shards over, compile nothing
    assert key(H100) == key(H100, SHARDED.model_copy(update={"gpu_memory_utilization": 0.5}))
    assert key(H100) == key(H100.model_copy(update={"gpu_count": 8}))


def test_gpu_memory_utilization_is_optional_and_bounded() -> None:
    assert EngineConfig.model_validate({"max_model_len": 2048, "kv_cache_gib": 1}).gpu_memory_utilization is None  # older manifests
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValidationError):
            EngineConfig(gpu_memory_utilization=bad)


def test_sharding_counts_the_gpus(smol: sources.Model) -> None:
    heads = json.loads((Path(smol.path) / "config.json").read_text())["num_attention_heads"]
    assert heads == 9  # SmolLM2-135M: splits over 3 devices, not over 2

    def refusals(degree: int, hw: platform.Hardware) -> list[str]:
        return techniques.check(recipes.parse({"sharding": {"tensor_parallel_size": degree}}), smol, hw).refusals

    assert refusals(2, H100.model_copy(update={"gpu_count": 1})) == [
        "tensor_parallel_size 2 needs 2 cuda devices but this machine has 1; use tensor_parallel_size 1"]
    assert refusals(2, EPYC) == ["tensor_parallel_size 2 needs 2 cpu devices but this machine has 1; use tensor_parallel_size 1"]
    assert refusals(2, H100) == ["9 attention heads do not split over 2 devices; use a degree that divides 9"]
    assert refusals(3, H100.model_copy(update={"gpu_count": 4})) == []

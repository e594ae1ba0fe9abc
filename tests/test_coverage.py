"""Models users bring: GGUF tokenizer rules honoured, chat templates carried over or supplied, broken
conversions caught at import, and the supported-models matrix from real runs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

import llmopt
from llmopt import catalog, coverage, gguf, sources
from llmopt.errors import LlmoptError
from llmopt.engine.config import CompilationConfig

from conftest import SMALL_ENGINE, run_cli

# these tests are about tokenizers and chat templates: a tiny model's compile (~20 s) buys them nothing
EAGER = SMALL_ENGINE.model_copy(update={"compilation": CompilationConfig(mode="eager")})

CI_ARCHITECTURES = ("qwen2",)  # llama: the packaged SmolLM2 is one, through every other test; the rest: slow tier
# Quantizing on qwen2 (llm-compressor's mappings for it) is in the slow tier and in benchmarks/recommend.py's
# runs on the catalogued Qwen2.5-Coder models; n-gram is the same job on any architecture, slow tier
CI_COLUMNS = ("import", "deploy")


def _write_gguf(path: Path, add_bos: bool) -> Path:
    """A small random-weight llama as a GGUF, with the default model's tokenizer and add_bos_token
    as asked: what a user's converted model looks like, built with the gguf package."""
    import gguf as gguf_lib

    smol = gguf.read(catalog.get(catalog.DEFAULT_MODEL).weight_files()[0])

    def field(key: str):
        f = smol.fields[key]
        return [bytes(f.parts[i]).decode("utf-8", errors="replace") if f.types[-1] == gguf_lib.GGUFValueType.STRING
                else f.parts[i].tolist()[0] for i in f.data]

    rng = np.random.default_rng(0)
    vocab, hidden, ff, heads, kv, layers = 49152, 128, 256, 4, 2, 2  # head_dim 32: the smallest vLLM CPU attends
    writer = gguf_lib.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)  # the session engine's max_model_len (vLLM refuses one longer than the model's)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    tensor = lambda *shape, scale=0.05: (rng.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", tensor(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output.weight", tensor(vocab, hidden, scale=1.0))  # large logits: a clear greedy choice
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv * hidden // heads, hidden)),
                            ("attn_v", (kv * hidden // heads, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)), ("ffn_down", (hidden, ff))):
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor(*shape))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.engine
def test_a_gguf_that_asks_for_a_bos_gets_one_in_vllm_and_transformers_alike(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = llmopt.import_model(str(_write_gguf(tmp_path / "bos.gguf", add_bos=True)), name="gguf-with-bos")
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    ids = tokenizer("The keeper of the lighthouse").input_ids
    assert ids[0] == 1 and json.loads((Path(model.path) / "tokenizer_config.json").read_text())["add_bos_token"] is True
    with llmopt.deploy(model.id, engine=EAGER) as endpoint:
        served = httpx.post(f"{endpoint.url}/tokenize", json={"model": endpoint.served_name, "prompt": "The keeper of the lighthouse"},
                            timeout=60).json()["tokens"]
        body = {"model": endpoint.served_name, "prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        completion = httpx.post(f"{endpoint.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    assert served == ids  # vLLM tokenizes exactly as the converted tokenizer does, BOS included
    weights = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.bfloat16)
    expected = weights.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert completion == expected


def test_a_broken_conversion_is_caught_at_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """transformers alone drops the GGUF's add_bos_token; without llmopt's fix the import check refuses it."""
    path = _write_gguf(tmp_path / "needs-bos.gguf", add_bos=True)
    monkeypatch.setattr(gguf, "apply_rules", lambda folder, rules: None)
    with pytest.raises(LlmoptError, match=r"broken conversion: the tokenizer does not add the BOS token \(id 1\)"):
        sources.import_model(str(path), name="broken-bos")
    assert sources.get("broken-bos") is None and not list((home / "models").glob(".import-broken-bos-*"))


def test_the_default_model_keeps_its_rules_and_template(smol: sources.Model) -> None:
    assert smol.chat_template == "model" and 5 < smol.perplexity < 100
    config = json.loads((Path(smol.path) / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"


def _tiny(folder: Path, model_type: str) -> Path:
    coverage.build(model_type, folder)
    assert not (folder / "chat_template.jinja").exists()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_chat_templates_come_from_the_model_the_user_or_the_family(smol: sources.Model, tmp_path: Path) -> None:
    qwen = sources.import_model(str(_tiny(tmp_path / "qwen", "qwen2")), name="tiny-qwen2-family")
    assert qwen.chat_template == "family:chatml" and "<|im_start|>" in (Path(qwen.path) / "chat_template.jinja").read_text()
    bare = run_cli("models", "import", str(_tiny(tmp_path / "llama", "llama")), "--name", "tiny-llama-bare")
    assert bare.returncode == 0 and "has no chat template" in bare.stderr and sources.get("tiny-llama-bare").chat_template is None
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    given = sources.import_model(str(tmp_path / "llama"), name="tiny-llama-given", chat_template=mine)
    assert given.chat_template == "user"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(LlmoptError, match="does not render"):
        sources.import_model(str(tmp_path / "llama"), name="tiny-llama-broken", chat_template=broken)


@pytest.mark.engine
def test_a_model_without_a_chat_template_refuses_chat_clearly_until_given_one(smol: sources.Model, tmp_path: Path) -> None:
    bare = sources.get("tiny-llama-bare") or sources.import_model(str(_tiny(tmp_path / "llama", "llama")), name="tiny-llama-bare")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with llmopt.deploy(bare.id, engine=EAGER) as endpoint:
        refused = httpx.post(f"{endpoint.url}/v1/chat/completions", json={**chat, "model": endpoint.served_name}, timeout=60)
        assert refused.status_code == 400 and "--chat-template FILE" in refused.json()["error"]["message"]
        sagemaker = httpx.post(f"{endpoint.url}/invocations", json=chat, timeout=60)
        assert sagemaker.status_code == 400 and "no chat template" in sagemaker.text
        prompt = {"model": endpoint.served_name, "prompt": "The lighthouse", "max_tokens": 4}
        assert httpx.post(f"{endpoint.url}/v1/completions", json=prompt, timeout=60).status_code == 200
        assert httpx.post(f"{endpoint.url}/invocations", json={"prompt": "The lighthouse", "max_tokens": 4}, timeout=60).status_code == 200
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    with llmopt.deploy(bare.id, engine=EAGER, chat_template=template) as endpoint:
        answered = httpx.post(f"{endpoint.url}/v1/chat/completions", json={**chat, "model": endpoint.served_name}, timeout=60)
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] > 0


@pytest.mark.engine
@pytest.mark.parametrize("model_type, columns", [
    pytest.param(t, CI_COLUMNS) if t in CI_ARCHITECTURES else pytest.param(t, coverage.COLUMNS, marks=pytest.mark.slow)
    for t in sorted(coverage.ARCHITECTURES)])
def test_coverage_runs_agree_with_the_published_matrix(model_type: str, columns: tuple[str, ...], smol: sources.Model,
                                                      tmp_path: Path) -> None:
    """What benchmarks/coverage.py published is what happens: one architecture beside llama in CI
    (import, and a deploy with a completion), every column of every one in the slow tier."""
    outcomes = coverage.run(model_type, tmp_path, columns)
    published = {(o.architecture, o.technique): o.status for o in coverage.load()}
    assert [(o.technique, o.status) for o in outcomes] == [(o.technique, published.get((o.architecture, o.technique)))
                                                          for o in outcomes]
    if model_type in CI_ARCHITECTURES:
        assert [o.technique for o in outcomes if o.status == "run"] == list(CI_COLUMNS)


def test_the_readme_table_is_the_matrix() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert coverage.markdown(coverage.load()) in readme, "README's supported-models table is stale: run benchmarks/coverage.py"


def test_a_head_size_vllm_cannot_attend_is_refused_and_the_engines_answer_is_kept(home: Path, tmp_path: Path) -> None:
    """The sizes come from vLLM's CPU attention once per installed engine version, then from the
    llmopt home; a damaged copy there is asked again, never trusted."""
    from llmopt import model_check
    from llmopt.engine import platform, vllm

    hardware = platform.detect()
    if hardware.device != "cpu":
        pytest.skip("llmopt knows the head sizes of vLLM's CPU attention only")
    folder = tmp_path / "odd-heads"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 48, "num_attention_heads": 3}))  # head size 16
    with pytest.raises(LlmoptError, match="attention takes head sizes .*this model's is 16"):
        model_check.attends_here(folder, hardware)
    kept = next((home / "engine-facts").glob("*-cpu-attention-head-sizes.json"))
    asked = json.loads(kept.read_text())
    assert 64 in asked and 16 not in asked
    kept.write_text("{not json")
    assert vllm.attention_head_sizes(hardware) == asked and json.loads(kept.read_text()) == asked

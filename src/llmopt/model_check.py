"""Checks of a freshly imported model folder, before it is recorded: a broken conversion is caught
here with a clear error, not later as an engine that answers nonsense.

- A GGUF's tokenizer rules hold in the converted tokenizer: the BOS and EOS it names, added when
  it says so.
- The model prefers the tokenizer's BOS rule: its perplexity on a short held-out text (through
  transformers) is no worse than with the opposite rule. A model trained with a BOS it no longer
  gets (an attention sink it relies on) does much worse without it; one trained without barely
  notices. A model that predicts worse than a uniform guess over its vocabulary (random weights)
  has learned no rule, and passes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from llmopt import corpus
from llmopt.engine import vllm
from llmopt.engine.platform import Hardware
from llmopt.errors import LlmoptError
from llmopt.gguf import TokenizerRules

MAX_TOKENS = 256  # of held-out text: enough to tell the rules apart, seconds even for a 1.5B model
FLOAT32_MAX_BYTES = 1 << 30  # bf16 weights up to this (half a billion parameters) are checked in float32
MARGIN = 0.9  # the opposite rule must beat the tokenizer's by more than 10% to count as preferred


def attends_here(folder: Path, hardware: Hardware) -> None:
    """vLLM's attention on this device takes the model's head size (checked before an engine starts)."""
    config = json.loads((folder / "config.json").read_text())
    sizes = vllm.attention_head_sizes(hardware)
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd")
    head = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    if sizes and head and head not in sizes:
        raise LlmoptError(f"vLLM's {hardware.device.upper()} attention takes head sizes {', '.join(map(str, sizes))}; "
                          f"this model's is {head}", "serve it on a GPU, or use a model with a supported head size")


def tokenizer_follows(folder: Path, rules: TokenizerRules) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)("The keeper of the lighthouse").input_ids
    for role, token_id, added, position in (("BOS", rules.bos_id, rules.add_bos, 0), ("EOS", rules.eos_id, rules.add_eos, -1)):
        if added is None or token_id is None:
            continue
        if (ids[position] == token_id) != added:
            raise LlmoptError(
                f"broken conversion: the tokenizer {'does not add' if added else 'adds'} the {role} token (id {token_id}) "
                f"that the GGUF says {'to add' if added else 'not to add'}",
                "report this with the GGUF's name; the converted tokenizer would change every prompt",
            )


def perplexity_prefers_the_rule(folder: Path) -> float:
    """The model's perplexity with the tokenizer's own rule; refused if the opposite BOS rule is clearly better.
    A small model in float32, which every x86 processor multiplies natively: its two passes took
    8.8 s in bf16 on a Zen 3 EPYC (AVX2, no bf16 instructions), a fifth of a GGUF import; a larger
    one in bf16, at half the memory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32 if weights <= FLOAT32_MAX_BYTES else torch.bfloat16)
    text = corpus.heldout_texts()[0]
    ids = tokenizer(text).input_ids[:MAX_TOKENS]
    bos = tokenizer.bos_token_id
    if bos is None:
        return _perplexity(model, ids)
    flipped = ids[1:] if ids[0] == bos else [bos, *ids]
    mine, other = _perplexity(model, ids), _perplexity(model, flipped)
    if min(mine, other) > len(tokenizer):  # worse than guessing uniformly: an untrained model, no rule to learn from
        return mine
    if other < MARGIN * mine:
        has = ids[0] == bos
        raise LlmoptError(
            f"broken conversion: the model does much better {'without' if has else 'with'} the BOS token its tokenizer "
            f"{'adds' if has else 'leaves out'} (perplexity {other:.1f} against {mine:.1f} on held-out text)",
            "fix the tokenizer's add_bos_token, or report the GGUF",
        )
    return mine


def _perplexity(model, ids: list[int]) -> float:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean")
    return math.exp(float(nll))

"""Quality of a served model against its base: perplexity, greedy agreement, task accuracy.

Everything is measured through the OpenAI-compatible server, so a quantized, speculative or
compiled deployment is measured exactly as it serves.
"""

from __future__ import annotations

import math
import re
import httpx
from pydantic import BaseModel

GREEDY_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the factorial of n.",
    "List three uses of a lighthouse.",
    "What happens to water when it freezes?",
)


# greedy is the raw argmax: vLLM would otherwise apply a generation_config's repetition penalty
# (Qwen2.5's 1.05) to chat requests, which prompt logprobs never see
GREEDY_SAMPLING = {"temperature": 0, "repetition_penalty": 1.0}
TIE_LOGPROB_GAP = 0.15  # about one bf16 step at the logit magnitudes of these models (0.125 at 16-32)


class Perplexity(BaseModel):
    perplexity: float
    tokens: int
    mean_nll: float


class Agreement(BaseModel):
    token_agreement: float  # position-wise, over the base's lengths
    identical_outputs: float  # share of outputs identical to the base's
    # of the base's greedy tokens, the share this model ranks first (or tied) given the base's answer so far
    forced_token_agreement: float | None = None


def perplexity(url: str, model: str, texts: list[str], timeout_s: float = 300.0,
               headers: dict[str, str] | None = None) -> Perplexity:
    """exp(mean negative log-likelihood) of every token after the first, from prompt logprobs."""
    total_nll, count = 0.0, 0
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for text in texts:
            body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            for entry in response.json()["choices"][0]["prompt_logprobs"][1:]:
                total_nll -= next(iter(entry.values()))["logprob"]
                count += 1
    mean = total_nll / max(count, 1)
    return Perplexity(perplexity=math.exp(mean), tokens=count, mean_nll=mean)


def greedy_tokens(url: str, model: str, prompts: tuple[str, ...] = GREEDY_PROMPTS, max_tokens: int = 48,
                  timeout_s: float = 300.0, headers: dict[str, str] | None = None, chat: bool = True) -> list[list[int]]:
    """Greedy completions' token ids, one list per prompt: through the chat template, as the model
    is used, or (`chat` false: a model without one) the prompt as plain text."""
    outputs = []
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for prompt in prompts:
            body = {"model": model, **_asked(prompt, chat), "max_tokens": max_tokens, **GREEDY_SAMPLING, "return_token_ids": True}
            response = client.post(f"{url}/v1/{'chat/' if chat else ''}completions", json=body)
            response.raise_for_status()
            outputs.append(response.json()["choices"][0]["token_ids"])
    return outputs


def _asked(prompt: str, chat: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}


def agreement(base: list[list[int]], other: list[list[int]], forced: float | None = None) -> Agreement:
    same_positions = sum(sum(1 for a, b in zip(x, y) if a == b) for x, y in zip(base, other))
    positions = sum(len(x) for x in base) or 1
    identical = sum(1 for x, y in zip(base, other) if x == y)
    return Agreement(token_agreement=same_positions / positions, identical_outputs=identical / max(len(base), 1),
                     forced_token_agreement=forced)


def forced_agreement(url: str, model: str, base: list[list[int]], prompts: tuple[str, ...] = GREEDY_PROMPTS,
                     timeout_s: float = 300.0, headers: dict[str, str] | None = None, chat: bool = True) -> float | None:
    """Of the base's greedy tokens, the share this model also ranks first, within a bf16 tie, when
    fed the base's answer so far (teacher forcing); None without tokens. Two free-running answers
    compared position by position part at the first near-tie and disagree on nearly every token
    after it, which says little about a quantization: SmoothQuant's SmolLM2 at +0.75% perplexity
    agreed on 24% of positions. It is a prefill's view, so it does not see how a speculating
    engine decodes: that is the position-wise comparison's job."""
    same = total = 0
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for prompt, tokens in zip(prompts, base):
            # tokenized as the chat request was: the template's generation prompt, no extra specials
            response = client.post(f"{url}/tokenize", json={"model": model, **_asked(prompt, chat)})
            response.raise_for_status()
            prefix = response.json()["tokens"]
            body = {"model": model, "prompt": prefix + tokens, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            for token, ranked in zip(tokens, response.json()["choices"][0]["prompt_logprobs"][len(prefix):]):
                best = max(entry["logprob"] for entry in ranked.values())
                total += 1
                same += best - ranked[str(token)]["logprob"] <= TIE_LOGPROB_GAP
    return same / total if total else None


def is_correct(answer: str, expected: str) -> bool:
    """The expected answer appears in the response, ignoring case, punctuation and spacing."""
    def norm(s: str) -> str:
        return " ".join(re.sub(r"[^a-z0-9 ]+", " ", s.lower()).split())

    return norm(expected) in norm(answer)


def divergences(url: str, model: str, tokenizer, base: list[list[int]], other: list[list[int]],
                prompts: tuple[str, ...] = GREEDY_PROMPTS) -> list[dict]:
    """Where two greedy outputs first part, and whether the base model saw a tie there.

    bf16 greedy decoding is not bit-stable across batch shapes (speculation verifies several
    tokens in one forward pass): two candidates whose logits are equal in bf16 can be ordered
    either way. A divergence is a tie when the base model's log-probabilities of the two tokens
    differ by at most TIE_LOGPROB_GAP; anything larger is a real difference.
    """
    found = []
    with httpx.Client(timeout=120) as client:
        for prompt, x, y in zip(prompts, base, other):
            position = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
            if position is None:
                continue
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=False)
            prefix = tokenizer(ids, add_special_tokens=False).input_ids + x[:position]
            body = {"model": model, "prompt": prefix, "max_tokens": 1, "temperature": 0, "logprobs": 20,
                    "return_tokens_as_token_ids": True}
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
            by_id = {int(k.split(":", 1)[1]): v for k, v in top.items()}
            gap = (by_id[x[position]] - by_id[y[position]]) if x[position] in by_id and y[position] in by_id else None
            found.append({"prompt": prompt, "position": position, "base_token": x[position], "other_token": y[position],
                          "logprob_gap": gap, "tie": gap is not None and abs(gap) <= TIE_LOGPROB_GAP})
    return found

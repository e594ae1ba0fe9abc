"""Quality of a served model against its base: perplexity, greedy agreement, task accuracy.

Everything is measured through the OpenAI-compatible server, so a quantized, speculative or
compiled deployment is measured exactly as it serves.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import httpx

GREEDY_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the factorial of n.",
    "List three uses of a lighthouse.",
    "What happens to water when it freezes?",
)


@dataclass
class Perplexity:
    perplexity: float
    tokens: int
    mean_nll: float

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity(url: str, model: str, texts: list[str], timeout_s: float = 300.0) -> Perplexity:
    """exp(mean negative log-likelihood) of every token after the first, from prompt logprobs."""
    total_nll, count = 0.0, 0
    with httpx.Client(timeout=timeout_s) as client:
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
                  timeout_s: float = 300.0) -> list[list[int]]:
    """Greedy chat completions' token ids, one list per prompt."""
    outputs = []
    with httpx.Client(timeout=timeout_s) as client:
        for prompt in prompts:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0, "return_token_ids": True}
            response = client.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()
            outputs.append(response.json()["choices"][0]["token_ids"])
    return outputs


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Position-wise token agreement (over the base's lengths) and the share of identical outputs."""
    same_positions = sum(sum(1 for a, b in zip(x, y) if a == b) for x, y in zip(base, other))
    positions = sum(len(x) for x in base) or 1
    identical = sum(1 for x, y in zip(base, other) if x == y)
    return {"token_agreement": same_positions / positions, "identical_outputs": identical / max(len(base), 1)}


def is_correct(answer: str, expected: str) -> bool:
    """The expected answer appears in the response, ignoring case, punctuation and spacing."""
    def norm(s: str) -> str:
        return " ".join(re.sub(r"[^a-z0-9 ]+", " ", s.lower()).split())

    return norm(expected) in norm(answer)

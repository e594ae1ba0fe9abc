"""A small synchronous OpenAI-compatible chat client, for the demo and for smoke checks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from llmopt.errors import LlmoptError


@dataclass
class ChatResult:
    text: str
    seconds_to_first_token: float
    seconds_total: float
    completion_tokens: int

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds_total - self.seconds_to_first_token
        return (self.completion_tokens - 1) / decode if self.completion_tokens > 1 and decode > 0 else 0.0


def chat(
    url: str,
    model: str,
    prompt: str,
    max_tokens: int = 64,
    temperature: float = 0.0,
    timeout_s: float = 120.0,
    headers: dict[str, str] | None = None,
) -> ChatResult:
    """Stream one chat completion and time it (`headers`: an endpoint's, when it asks for a key)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    tokens = 0
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout_s, headers=headers) as response:
            if response.status_code != 200:
                raise LlmoptError(f"{url} answered HTTP {response.status_code}: {response.read()[:200]!r}", "check the endpoint's logs")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        first = first if first is not None else time.perf_counter() - start
                        parts.append(delta)
    except httpx.TransportError as exc:
        raise LlmoptError(f"cannot reach {url} ({exc})", "check that the endpoint is running: `llmopt endpoints list`") from exc
    total = time.perf_counter() - start
    return ChatResult("".join(parts), first if first is not None else total, total, tokens)

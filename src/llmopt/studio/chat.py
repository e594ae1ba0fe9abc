"""The chat playground's proxy: a conversation sent to an endpoint's OpenAI-compatible
`/v1/chat/completions` with the endpoint's own headers (its API key stays on the server), streamed
back to the page token by token as server-sent events: `token` (a JSON string), then `done` (usage
and timing) or `error` (a problem and its fix)."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Literal

import httpx
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from llmopt import sdk
from llmopt.errors import LlmoptError
from llmopt.studio.problems import ERRORS, lookup

api = APIRouter(tags=["endpoints"], responses=ERRORS)
TIMEOUT = httpx.Timeout(600.0, connect=5.0)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=200_000)


class Chat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Message] = Field(min_length=1, max_length=200)
    max_tokens: int = Field(256, gt=0, le=32768)
    temperature: float = Field(0.7, ge=0, le=2)


def _event(kind: str, data: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps(data)}


async def relay(url: str, headers: dict[str, str], served_name: str, chat: Chat) -> AsyncIterator[dict[str, str]]:
    body = {"model": served_name, "messages": [m.model_dump() for m in chat.messages], "max_tokens": chat.max_tokens,
            "temperature": chat.temperature, "stream": True, "stream_options": {"include_usage": True}}
    start, first, usage = time.perf_counter(), None, None
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    text = (await response.aread())[:300].decode(errors="replace")
                    yield _event("error", {"error": f"the endpoint answered {response.status_code}: {text}", "fix": "see its log"})
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            first = first if first is not None else time.perf_counter() - start
                            yield _event("token", text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        yield _event("error", {"error": f"the endpoint stopped answering ({type(exc).__name__})", "fix": "see its log"})
        return
    yield _event("done", {"usage": usage, "seconds_to_first_token": first, "seconds": time.perf_counter() - start})


@api.post("/endpoints/{name}/chat", summary="Chat with an endpoint, streamed as server-sent events",
          response_description="text/event-stream: `token` events, then `done` or `error`")
async def chat(name: str, body: Chat) -> EventSourceResponse:
    endpoint = await run_in_threadpool(lookup, sdk.get_endpoint, name)
    if endpoint.status != "READY":
        raise LlmoptError(f"endpoint '{name}' is {endpoint.status}", "chat with a READY endpoint")
    return EventSourceResponse(relay(endpoint.url, endpoint.headers, endpoint.served_name, body))

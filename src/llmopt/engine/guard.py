"""What llmopt adds in front of vLLM's server (loaded with `--middleware`).

- The API key on every route. vLLM's own `--api-key` guards only paths under /v1, /v2,
  /inference and /cohere: /invocations (SageMaker's route, which takes the same requests),
  /metrics, /tokenize and the rest stay open. This checks the key vLLM reads (VLLM_API_KEY) on all
  of them, in constant time.
- For a model with no chat template, chat requests get a clear answer (what to do) instead of
  vLLM's bare "no chat template" error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

API_KEY_ENV = "VLLM_API_KEY"
NO_CHAT_ENV = "LLMOPT_NO_CHAT_TEMPLATE"
CHAT_ROUTES = ("/v1/chat/completions", "/invocations")
NO_CHAT = (b'{"error": {"message": "this model has no chat template, so it cannot take chat messages: deploy it with '
           b'--chat-template FILE (a Jinja template), or send prompts to /v1/completions", "type": "BadRequestError", "code": 400}}')


class Guard:
    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(API_KEY_ENV, "")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None
        self.no_chat = os.environ.get(NO_CHAT_ENV) == "1"

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = dict(headers).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.digest or b"")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if self.digest is not None and not self.allowed(scope.get("headers") or []):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _answer(send, 401, b'{"error": "Unauthorized: pass the endpoint\'s API key as a Bearer token"}',
                          [(b"www-authenticate", b"Bearer")])
            return
        if self.no_chat and scope.get("path") in CHAT_ROUTES and scope.get("method") == "POST":
            received = await _body(receive)
            if scope["path"] != "/invocations" or b'"messages"' in b"".join(m.get("body", b"") for m in received):
                await _answer(send, 400, NO_CHAT)
                return

            async def replay() -> dict:
                return received.pop(0) if received else await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


async def _body(receive: Any) -> list[dict]:
    """Every message of a request's body (SageMaker's route takes prompts and chats alike: look before passing it on)."""
    found = [await receive()]
    while found[-1].get("more_body"):
        found.append(await receive())
    return found


async def _answer(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})

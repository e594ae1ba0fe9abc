"""The API-key check llmopt adds to vLLM's server (loaded with `--middleware`).

vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and /cohere: /invocations
(SageMaker's route, which takes the same requests), /metrics, /tokenize and the rest stay open.
This guards every route, with the key vLLM reads (VLLM_API_KEY), compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

API_KEY_ENV = "VLLM_API_KEY"


class Guard:
    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(API_KEY_ENV, "")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = dict(headers).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.digest or b"")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.digest is None or scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if self.allowed(scope.get("headers") or []):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": b'{"error": "Unauthorized: pass the endpoint\'s API key as a Bearer token"}'})

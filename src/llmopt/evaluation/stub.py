"""A stub OpenAI-compatible streaming server that answers as fast as it can: it measures the
load generator itself (and lets tests kill a server mid-run without an engine)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx

from aiohttp import web


def make_app(tokens_per_request: int, delay_s: float) -> web.Application:
    answered = 0  # whole answers sent: a test waits on them rather than on the clock of a loaded machine

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"answered": answered})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model", "root": None}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        count = int(body.get("max_tokens") or tokens_per_request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": " tok"}}]}).encode() + b"\n\n"
        for _ in range(count):
            await response.write(chunk)
            if delay_s:
                await asyncio.sleep(delay_s)
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": count}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        nonlocal answered
        answered += 1
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def start(tokens: int = 1000, delay_s: float = 0.0) -> tuple[str, subprocess.Popen]:
    """Run the stub in its own process on a free port; returns its URL once it answers."""
    from llmopt.engine.vllm import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmopt.evaluation.stub", "--port", str(port),
                             "--tokens", str(tokens), "--delay", str(delay_s)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(f"{url}/v1/models", timeout=1)
            return url, proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the stub server did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    web.run_app(make_app(args.tokens, args.delay), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()

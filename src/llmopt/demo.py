"""`llmopt demo`: the main job on the default model, end to end on the real engine."""

from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.table import Table

from llmopt import client, sdk, sources

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about a fast computer.",
    "Give three tips for writing clear code.",
)


def run(model: str, max_tokens: int, console: Console, working: Callable) -> None:
    with working(f"importing {model} (once)"):
        imported = sources.resolve(model)
    console.print(f"model [bold]{imported.id}[/] at {imported.path} (sha256 {imported.content_hash[:12]})")
    with working("starting vLLM (60-100 s on 2 cores)"):
        endpoint = sdk.deploy(imported.id)
    with endpoint:
        console.print(f"endpoint {endpoint.name} ready at {endpoint.url} in {endpoint.seconds_to_ready:.1f} s")
        table = Table(title=f"{imported.id} on vLLM", show_lines=True)
        for column in ("prompt", "answer", "TTFT ms", "total s", "tokens", "tok/s"):
            table.add_column(column)
        for prompt in PROMPTS:
            result = client.chat(endpoint.url, endpoint.served_name, prompt, max_tokens=max_tokens)
            table.add_row(
                prompt,
                result.text.strip(),
                f"{result.seconds_to_first_token * 1000:.0f}",
                f"{result.seconds_total:.2f}",
                str(result.completion_tokens),
                f"{result.tokens_per_second:.1f}",
            )
        console.print(table)
    console.print(f"stopped {endpoint.name}")

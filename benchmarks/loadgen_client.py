"""How many streamed tokens per second the load generator sustains against a stub server.

The stub (llmopt.evaluation.stub) runs in its own process and streams one token per SSE chunk
without delay; the client runs llmopt's real loadgen.run_level. Target: >= 20,000 tokens/s.
Writes benchmarks/results/loadgen_client.json.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from llmopt.evaluation import loadgen, stub
from llmopt.evaluation.workload import Request, Workload

TOKENS_PER_REQUEST = 2000
REQUESTS = 64
TARGET = 20_000


def main() -> None:
    url, server = stub.start(tokens=TOKENS_PER_REQUEST)
    try:
        work = Workload("stub", [Request(({"role": "user", "content": "hi"},), TOKENS_PER_REQUEST)])
        rows = []
        for concurrency in (1, 8, 32):
            run = asyncio.run(loadgen.run_level(url, "stub", work, concurrency, loadgen.RunSettings(REQUESTS, None, 0), {}))
            chunks = sum(len(r.chunk_times) for r in run.records)
            errors = sum(1 for r in run.records if r.error)
            rows.append({"concurrency": concurrency, "requests": len(run.records), "errors": errors,
                         "streamed_tokens": chunks, "seconds": round(run.duration, 3),
                         "tokens_per_s": round(chunks / run.duration)})
    finally:
        server.terminate()
        server.wait(10)
    print(f"{'concurrency':>11} {'requests':>8} {'errors':>6} {'tokens':>8} {'seconds':>8} {'tokens/s':>9}")
    for row in rows:
        print(f"{row['concurrency']:>11} {row['requests']:>8} {row['errors']:>6} {row['streamed_tokens']:>8} {row['seconds']:>8} {row['tokens_per_s']:>9}")
    best = max(r["tokens_per_s"] for r in rows)
    print(f"best {best} tokens/s; target {TARGET}: {'met' if best >= TARGET else 'NOT met'}")
    out = Path(__file__).parent / "results" / "loadgen_client.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"target_tokens_per_s": TARGET, "rows": rows, "met": best >= TARGET}, indent=2))


if __name__ == "__main__":
    main()

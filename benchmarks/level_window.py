"""Whether a load level's length moves its total tokens/s: one bf16 deployment of SmolLM2-135M on
the built-in QA workload at concurrency 4 and 8 (as `recommend` loads it), on equal work (both
levels send the same prompts at their natural lengths, in whole passes), with levels of at least
10 s (`recommend`'s) and of at least 40 s, alternating. A level's window runs
from its first request sent to its last ended, so its start burst and its drain count; a longer
level dilutes both. With `--prefill-only`, every request asks for one token at concurrency 1, 4
and 8, so a level is its prompts' prefills alone, and the table gives prompt tokens/s.

    .venv/bin/python benchmarks/level_window.py [--rounds N] [--prefill-only]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import llmopt
from llmopt.endpoints import Endpoint
from llmopt.evaluation import levels

RESULTS = Path(__file__).parent / "results" / "level_window.json"
PREFILL_RESULTS = RESULTS.with_name("level_window_prefill.json")
MIN_SECONDS = (10.0, 40.0)


def prefill_only(endpoint: Endpoint, rounds: int) -> list[dict]:
    """Prompt tokens/s with one output token a request: whether batching prefills pays here."""
    plan = levels.Plan(dataset="builtin-qa", concurrency=(1, 4, 8), requests=8, min_duration_s=15.0, output_tokens=1)
    rows = []
    for round_ in range(rounds):
        for level in levels.measure(endpoint.url, endpoint.served_name, endpoint.model_path, plan):
            rows.append({"round": round_, "c": level.concurrency, "prompt_tok_s": round(level.input_tokens_per_s, 1),
                         "requests": level.invocations, "ttft_p50": round(level.ttft_ms.p50)})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill-only", action="store_true")
    args = parser.parse_args()
    rows = []
    with llmopt.deploy("smollm2-135m-instruct", name="level-window") as endpoint:
        if args.prefill_only:
            PREFILL_RESULTS.write_text(json.dumps(prefill_only(endpoint, args.rounds), indent=1))
            return
        base = levels.Plan(dataset="builtin-qa", concurrency=(4, 8), requests=8, min_duration_s=MIN_SECONDS[0])
        lengths = levels.natural_lengths(endpoint.url, endpoint.served_name, endpoint.model_path, base)
        for round_ in range(args.rounds):
            for seconds in MIN_SECONDS:
                plan = base.model_copy(update={"min_duration_s": seconds})
                for level in levels.measure(endpoint.url, endpoint.served_name, endpoint.model_path, plan, lengths=lengths):
                    rows.append({"round": round_, "min_s": seconds, "c": level.concurrency,
                                 "total_out_tok_s": round(level.output_tokens_per_s, 1), "requests": level.invocations,
                                 "duration_s": round(level.duration_s, 1), "ttft_p50": round(level.ttft_ms.p50),
                                 "tpot_p50": round(level.tpot_ms.p50, 1) if level.tpot_ms else None})
                    print(rows[-1], flush=True)
    RESULTS.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

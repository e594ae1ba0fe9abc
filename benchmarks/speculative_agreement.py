"""Whether speculative decoding changes what a model answers: greedy answers to the built-in QA
prompts from an artifact that speculates and from one that does not (the same weights), each
deployed once with llmopt's kernel library as built now and, with `--kernel PATH`, once with
another build of it (a copy kept from before a change), and how many answers each pair of
deployments gives alike. At temperature 0 a verifying step should pick the tokens that decoding
them one at a time picks; where the verifying step's attention runs other arithmetic than a
decode's (another kernel), answers can part at near-ties, and a parted answer can run on to its
length limit, which n-gram drafts then predict well: more output tokens a second for a different
answer. Writes results/speculative_agreement.json (or --out).

    .venv/bin/python benchmarks/speculative_agreement.py SPECULATIVE PLAIN [--kernel PATH] [--requests N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import llmopt
import results_file
from engine_cpu_settings import environment_over
from llmopt import client
from llmopt.engine import kernels, platform
from llmopt.evaluation import workload


def answers(model: str, library: str | None, requests: list[workload.Request]) -> list[str]:
    """Greedy answers from one deployment of `model`, with the kernel library at `library` if given."""
    with environment_over({kernels.LIBRARY_ENV: library} if library else {}):
        with llmopt.deploy(model) as endpoint:
            # a built-in QA request is one user message
            return [client.chat(endpoint.url, endpoint.served_name, request.messages[0]["content"],
                                max_tokens=request.max_tokens, timeout_s=600).text for request in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("speculative", help="an artifact (folder) that speculates")
    parser.add_argument("plain", help="an artifact (folder) of the same weights that does not")
    parser.add_argument("--kernel", metavar="PATH", help="another build of llmopt's kernel library, deployed too")
    parser.add_argument("--requests", type=int, default=8, help="built-in QA prompts (default 8)")
    results_file.add_out(parser, "speculative_agreement.json")
    args = parser.parse_args()
    requests = workload.builtin_qa(0, args.requests).requests
    builds = {"current": None} | ({"other": str(Path(args.kernel).resolve())} if args.kernel else {})
    texts = {f"{kind}, {build} kernels": answers(model, library, requests)
             for build, library in builds.items() for kind, model in (("speculative", args.speculative), ("plain", args.plain))}
    labels = list(texts)
    alike = {a: {b: sum(x == y for x, y in zip(texts[a], texts[b])) for b in labels} for a in labels}
    print(f"answers alike, of {args.requests}:")
    print(f"{'':<34}" + "".join(f"{label:>34}" for label in labels))
    for a in labels:
        print(f"{a:<34}" + "".join(f"{alike[a][b]:>34}" for b in labels))
    print("answer lengths (characters):")
    for label in labels:
        print(f"{label:<34} {[len(t) for t in texts[label]]}")
    args.out.write_text(json.dumps({"processor": platform.detect().cpu_label, "speculative": args.speculative,
                                    "plain": args.plain, "kernel": args.kernel, "requests": args.requests,
                                    "alike": alike, "answers": texts}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Occlusion evidence's cost against one decision (BENCHMARKS.md, docs/evidence.md): a one-question
request with a state grown to each prompt length, a plain decision and an occlusion one (`top` 3)
alternating (ABAB, then BABA), the model's state cache off so that every decision decodes its state.

    clef-gguf demo ./small --preset small --outtype q8_0
    python benchmarks/occlusion_cost.py ./small --tokens 500 2000 --rounds 5
"""

import argparse
import statistics
import time

from clef_gguf import Clef

QUESTIONS = {"urgent": {"type": "noul", "instructions": "Urgent?"}}
WORDS = ("the parcel arrived late and the box was damaged so the customer asked for a refund "
         "before friday while support never answered two emails about order 1182").split()
EVIDENCE = {"mode": "occlusion", "top": 3}


def state_of(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] + ("." if i % 17 == 16 else "") for i in range(n_words))


def timed(clef: Clef, body: dict, evidence: dict | None) -> tuple[float, float, dict]:
    """(CPU seconds of the process, wall seconds, response) of one decision."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = clef.decide(body, evidence=evidence)
    return time.process_time() - cpu, time.perf_counter() - wall, out


def measure(clef: Clef, target: int, rounds: int) -> None:
    n = 10
    while clef.prepare({"state": state_of(n), "questions": QUESTIONS}).encoded.n_tokens < target:
        n += 10
    body = {"state": state_of(n), "questions": QUESTIONS}
    enc = clef.prepare(body).encoded
    clef.decide(body)  # warm-up: the kept system prefix, allocations
    cpu, wall, plain_cpu = [], [], []
    for r in range(rounds):
        first_plain = (r // 2) % 2 == 0
        runs = {}
        for kind in ("plain", "occlusion") if first_plain else ("occlusion", "plain"):
            runs[kind] = timed(clef, body, EVIDENCE if kind == "occlusion" else None)
        cpu.append(runs["occlusion"][0] / runs["plain"][0])
        wall.append(runs["occlusion"][1] / runs["plain"][1])
        plain_cpu.append(runs["plain"][0])
    evidence = runs["occlusion"][2]["evidence"]
    starts = sorted({s["start"] for s in evidence["questions"]["urgent"]["spans"]})
    print(f"{enc.n_tokens} tokens (state {enc.state_tokens} tokens, {len(body['state'])} characters): "
          f"{evidence['reruns']} re-runs, spans at characters {starts}; one decision "
          f"{statistics.median(plain_cpu):.2f} s CPU (median); occlusion / one decision: "
          f"CPU {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}), "
          f"wall {statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}), {rounds} rounds", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory (clef-gguf demo DIR --preset small --outtype q8_0)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[500, 2000], help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per length")
    parser.add_argument("--threads", type=int, default=2, help="the tower's threads")
    args = parser.parse_args()
    with Clef.load(args.model, state_cache_mb=0, threads=args.threads) as clef:
        for target in args.tokens:
            measure(clef, target, args.rounds)


if __name__ == "__main__":
    main()

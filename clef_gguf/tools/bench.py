"""``clef-gguf bench``: where the time of one decision goes on this machine (median ms per stage).

The request is synthetic: a state padded to about ``--tokens`` prompt tokens and three questions
(noul, 4-way choice, 5-level score). Stages are measured inside one process, side by side, so the
split is meaningful even on a noisy shared machine; absolute numbers are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from clef_gguf.argtypes import positive_int
from clef_gguf.errors import InvalidValue
from clef_gguf.statecache import StateCache

SENTENCE = ("Customer 4471 reports that the March invoice was charged twice and asks for a refund "
            "of the duplicate payment before the end of the week. ")
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Should the duplicate charge be refunded?"},
    "team": {"type": "choice", "instructions": "Which team handles this?",
             "criteria": {"billing": "Payments, invoices and refunds", "support": None,
                          "fraud": "Suspicious activity", "sales": "Plans and upgrades"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["none", "low", "medium", "high", "critical"]},
}


# Four question sets about one state, for --versus reuse.
REUSE_SETS = [{"refund": QUESTIONS["refund"]}, {"team": QUESTIONS["team"]},
              {"urgency": QUESTIONS["urgency"]},
              {"refund": QUESTIONS["refund"], "urgency": QUESTIONS["urgency"]}]


def sized_request(clef, tokens: int) -> dict:
    """A request whose prompt is as close to ``tokens`` as whole sentences allow (not over).

    Questions are dropped from the end (keeping one) while they alone exceed the target: small
    demo tokenizers spend several times more tokens on the same text than the release's.
    """
    names = list(QUESTIONS)
    while True:
        base = {"state": "", "questions": {k: QUESTIONS[k] for k in names}}
        fixed = clef.prepare(base).encoded.n_tokens
        if fixed <= tokens or len(names) == 1:
            break
        names.pop()
    per = max(1, len(clef.encoder.tokenizer.encode(SENTENCE, add_special_tokens=False).ids))
    n = max(0, (tokens - fixed) // per)
    while n > 0 and clef.prepare({**base, "state": SENTENCE * n}).encoded.n_tokens > tokens:
        n -= 1
    return {**base, "state": SENTENCE * n}


def measure(clef, request: dict, repeat: int) -> dict:
    clef.run(clef.prepare(request))  # warm-up: page in the mmap, fill the lexical cache
    runs = [clef.run(clef.prepare(request))[1] for _ in range(repeat)]
    stages = ("encode", "tower", "lexical", "head", "answer", "total")
    return {"tokens": runs[0]["tokens"], "questions": list(request["questions"]), "repeat": repeat,
            "median_ms": {s: round(statistics.median(r[s] for r in runs), 2) for s in stages}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from clef_gguf.cli_options import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--tokens", type=positive_int, default=400, help="prompt size to aim for (default 400)")
    p.add_argument("--repeat", type=positive_int, default=5,
                   help="measured runs after one warm-up (default 5)")
    p.add_argument("--versus", choices=["prefill", "reuse", "transformers"],
                   help="instead of the stage split, a side-by-side ratio (alternating rounds, "
                        "median and spread): prefill = a decision vs a bare llama.cpp prefill of "
                        "the same ids; reuse = 4 question sets about one --tokens state with the "
                        "state cache vs 4 plain decisions; transformers = a decision vs the "
                        "transformers reference of --release")
    p.add_argument("--release", help="the Hugging Face release directory, for --versus "
                   "transformers (the demo keeps it in DEMO_DIR/release)")
    p.add_argument("--rounds", type=positive_int, default=7,
                   help="rounds for --versus (default 7)")


def run(args: argparse.Namespace) -> int:
    from clef_gguf.cli_options import load_model

    with load_model(args) as clef:
        if args.versus:
            from clef_gguf.tools import versus

            if args.versus == "prefill":
                result = versus.versus_prefill(clef, sized_request(clef, args.tokens), args.rounds)
            elif args.versus == "transformers":
                if not args.release:
                    raise InvalidValue("--versus transformers needs --release DIR", field="release")
                result = versus.versus_transformers(clef, sized_request(clef, args.tokens),
                                                    args.release, args.rounds)
            else:
                state = sized_request(clef, args.tokens)["state"]
                result = versus.versus_reuse(clef, state, REUSE_SETS, args.rounds)
            result |= {"model": clef.info["name"], "threads": clef.tower.threads}
            print(json.dumps(result, indent=2))
            return 0
        clef.state_cache = StateCache(0)  # the cost of a decision, not of a cache hit
        request = sized_request(clef, args.tokens)
        result = measure(clef, request, args.repeat)
        if result["tokens"] > args.tokens:  # say so rather than silently measure something else
            result["note"] = (f"the questions alone take {result['tokens']} tokens with this "
                              f"tokenizer, more than --tokens {args.tokens}")
        result |= {"model": clef.info["name"], "quant": clef.info["quant"],
                   "head_dtype": clef.info["head_dtype"], "threads": clef.tower.threads}
    print(json.dumps(result, indent=2))
    return 0

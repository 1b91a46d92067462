"""``clef-gguf bench``: where the time of one decision goes on this machine (median ms per stage).

The request is synthetic (``tools/workload.py``): a state padded to about ``--tokens`` prompt tokens
and three questions (noul, 4-way choice, 5-level score). Stages are measured inside one process, side by side, so the
split is meaningful even on a noisy shared machine; absolute numbers are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from clef_gguf.core.argtypes import positive_int
from clef_gguf.core.errors import InvalidValue
from clef_gguf.tools.workload import QUESTIONS, REUSE_SETS, records, sized_request, with_picture
from clef_gguf.tower.cache import StateCache


def measure(clef, request: dict, repeat: int) -> dict:
    clef.run(clef.prepare(request))  # warm-up: page in the mmap, fill the lexical cache
    runs = [clef.run(clef.prepare(request))[1] for _ in range(repeat)]
    stages = ("encode", "tower", "lexical", "head", "answer", "total")
    return {"tokens": runs[0]["tokens"], "questions": list(request["questions"]), "repeat": repeat,
            "median_ms": {s: round(statistics.median(r[s] for r in runs), 2) for s in stages}}


def measure_picture(clef, request: dict, repeat: int) -> dict:
    """The stage split of a decision carrying a picture, every run cold (state and vision caches
    emptied), and the picture's share of it: vision ms / total ms per run, median and range."""
    def once() -> dict:
        clef.state_cache.clear()
        if clef.media.cache is not None:
            clef.media.cache.clear()
        return clef.run(clef.prepare(request))[1]
    once()  # warm-up: loads the vision tower, pages in the tower
    runs = [once() for _ in range(repeat)]
    stages = ("encode", "vision", "tower", "lexical", "head", "answer", "total")
    shares = [r["vision"] / r["total"] for r in runs]
    return {"tokens": runs[0]["tokens"], "questions": list(request["questions"]), "repeat": repeat,
            "median_ms": {s: round(statistics.median(r[s] for r in runs), 2) for s in stages},
            "picture_share": {"median": round(statistics.median(shares), 4), "min": round(min(shares), 4),
                              "max": round(max(shares), 4)}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from clef_gguf.runtime.flags import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--tokens", type=positive_int, default=400, help="prompt size to aim for (default 400)")
    p.add_argument("--repeat", type=positive_int, default=5,
                   help="measured runs after one warm-up (default 5)")
    p.add_argument("--picture", type=positive_int, metavar="SIZE",
                   help="add one SIZE x SIZE picture to the request (448: 196 tokens on Clef-Flash); the "
                        "split then has the vision stage, every run is cold (state and vision caches "
                        "emptied), and picture_share is the vision tower's part of the whole decision "
                        "per run (median, min-max); --tokens counts the picture's tokens too")
    p.add_argument("--versus", choices=["prefill", "reuse", "transformers", "llama-server", "packed"],
                   help="instead of the stage split, a side-by-side ratio (alternating rounds, "
                        "median and spread): prefill = a decision vs a bare llama.cpp prefill of "
                        "the same ids; reuse = 4 question sets about one --tokens state with the "
                        "state cache vs 4 plain decisions; transformers = a decision vs the "
                        "transformers reference of --release; llama-server = a decision and 4 "
                        "question sets vs upstream llama-server's native clef path (see below); "
                        "packed = --requests decisions of about --tokens tokens with --pack prompts "
                        "per llama_decode vs one at a time")
    p.add_argument("--release", help="the Hugging Face release directory, for --versus "
                   "transformers (the demo keeps it in DEMO_DIR/release)")
    p.add_argument("--rounds", type=positive_int, default=7,
                   help="rounds for --versus (default 7)")
    p.add_argument("--pack", type=positive_int, default=4,
                   help="prompts per llama_decode, for --versus packed (default 4)")
    p.add_argument("--requests", type=positive_int, default=8,
                   help="distinct records per round, for --versus packed (default 8)")
    p.add_argument("--mixed", action="store_true",
                   help="--versus packed on records of 80-100 %% of --tokens, no two as long")
    p.add_argument("--synthetic", action="store_true",
                   help="--versus packed on the tower alone, prompts of exactly --tokens synthetic ids "
                        "(for sizes the model's template cannot make)")
    from clef_gguf.tools import versus_server

    versus_server.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from clef_gguf.runtime.flags import load_model

    with load_model(args) as models:
        clef = models.default_model  # the model timed: the fine-tune when one --adapter is given
        if args.versus:
            from clef_gguf.tools import versus

            if args.versus == "llama-server":
                from clef_gguf.tools import versus_server

                result = versus_server.from_args(clef, args, sized_request(clef, args.tokens), REUSE_SETS)
            elif args.versus == "packed" and args.synthetic:
                result = versus.versus_packed_tower(clef, args.tokens, args.requests, args.pack, args.rounds)
            elif args.versus == "packed":
                result = versus.versus_packed(clef, records(clef, args.tokens, args.requests, args.mixed),
                                              args.pack, args.rounds) | {"mixed": args.mixed}
            elif args.versus == "prefill":
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
        if args.picture:
            if not clef.media.available:
                raise InvalidValue(f"{clef.info['name']} has no vision tower: --picture needs one", field="picture")
            bare = with_picture({"state": "", "questions": {"refund": QUESTIONS["refund"]}}, args.picture)
            picture_tokens = clef.prepare(bare).encoded.n_tokens - clef.prepare({**bare, "images": []}).encoded.n_tokens
            request = with_picture(sized_request(clef, max(1, args.tokens - picture_tokens)), args.picture)
            result = measure_picture(clef, request, args.repeat) | {"picture": args.picture,
                                                                  "picture_tokens": picture_tokens}
        else:
            request = sized_request(clef, args.tokens)
            result = measure(clef, request, args.repeat)
        if result["tokens"] > args.tokens:  # say so rather than silently measure something else
            result["note"] = (f"the questions alone take {result['tokens']} tokens with this "
                              f"tokenizer, more than --tokens {args.tokens}")
        result |= {"model": clef.info["name"], "quant": clef.info["quant"],
                   "head_dtype": clef.info["head_dtype"], "threads": clef.tower.threads}
    print(json.dumps(result, indent=2))
    return 0

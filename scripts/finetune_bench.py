"""Fine-tunes at run time on the ~110M random model: speed against the merged release, the cost of
switching fine-tunes, memory per fine-tune, and how close a quantized base + adapter comes to the
merged-then-quantized release. Prints one JSON report.

    python scripts/finetune_bench.py WORKDIR [--preset small] [--rank 64] [--rounds 9] [--tokens 512]
                                     [--threads 2] [--speed-types f32,Q4_K_M] [--types Q8_0,Q4_K_M]

Builds in WORKDIR (rerunning reuses what is there): the ``small`` demo release, its f32 conversion,
two random fine-tunes (``clef_gguf.convert.synthetic.finetune_demo``, clef-finetune's defaults: rank 64,
alpha 128) converted with ``clef-gguf convert adapter`` (f16, its default), fine-tune ``a`` merged
by clef-finetune's own ``merge`` (float32, so the merge adds no rounding of its own), and each type
of the base and of the merge.

- speed: ``decide`` on base TYPE + adapter against the merged release at TYPE, in one process,
  alternating A/B (order flipped every round), state cache off so that every round decodes;
- switching: a decision through fine-tune a right after one through b against one right after one
  through a (distinct prompts of one length, state cache off);
- memory: peak RSS of a process that loaded the base with 0, 1 and 2 fine-tunes and answered one
  request through each, one child process each;
- parity: max |dp| over the parity tool's sample requests, base TYPE + adapter against the merge at
  TYPE, and both against the merged f32 GGUF (which matches the transformers reference of the
  merge; tests/runtime/test_finetune.py holds that within 2e-3 on the tiny model).

Random weights: evidence about the runtime's cost and quantization noise, not about Clef-Flash.
Needs peft and clef-finetune (the test dependencies) for the merge.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from clef_gguf.core.limits import MiB

SEED = 0
NAMES = {"a": 1, "b": 2}  # fine-tune name -> seed


def built(path: Path, make: Any) -> Path:
    """``path``, made by ``make(path)`` unless a previous run left it there."""
    if not path.exists():
        print(f"finetune_bench: making {path.name}", file=sys.stderr, flush=True)
        make(path)
    return path


def prepare(work: Path, preset: str, rank: int, threads: int, types: list[str]) -> dict[str, Any]:
    """Every file the measurements need, as paths: release, base and merged models by type, fine-tunes."""
    from clef_finetune.export import merge

    from clef_gguf.convert.synthetic.finetune_demo import build_finetune_checkpoint
    from clef_gguf.convert.lora import convert_adapter
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release
    from clef_gguf.tools.quant_table import make_model

    release = built(work / "release", lambda p: build_release(p, preset=preset, seed=SEED))
    base = {"f32": built(work / "model-f32", lambda p: convert_release(
        release, p, outtype="f32", name=f"clef-{preset}-random"))}
    tunes = {}
    for name, seed in NAMES.items():
        ckpt = built(work / f"checkpoint-{name}", lambda p, s=seed: build_finetune_checkpoint(
            release, p, seed=s, rank=rank))
        tunes[name] = built(work / f"finetune-{name}", lambda p, c=ckpt, n=name: convert_adapter(
            c, p, base=base["f32"], name=n))
    merged_release = built(work / "merged-release", lambda p: merge(
        release, work / "checkpoint-a", p, dtype="float32", head_dtype="float32"))
    merged = {"f32": built(work / "merged-f32", lambda p: convert_release(
        merged_release, p, outtype="f32", name=f"clef-{preset}-merged-a"))}
    for qtype in types:
        if qtype == "f32":
            continue
        base[qtype] = built(work / f"model-{qtype}", lambda p, q=qtype: make_model(
            base["f32"], release, q, p, threads=threads))
        merged[qtype] = built(work / f"merged-{qtype}", lambda p, q=qtype: make_model(
            merged["f32"], merged_release, q, p, threads=threads))
    return {"release": release, "base": base, "merged": merged, "finetunes": tunes}


def summary(a_ms: list[float], b_ms: list[float]) -> dict[str, Any]:
    """Per-round A/B ratios (median, min, max), each side's median, and the ratio of the fastest
    rounds: on a shared machine the minimum is the time least disturbed by other work."""
    ratios = [a / b for a, b in zip(a_ms, b_ms)]
    return {"rounds": len(ratios), "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            "ratio_of_fastest": round(min(a_ms) / min(b_ms), 3),
            "a_ms_median": round(statistics.median(a_ms), 2), "b_ms_median": round(statistics.median(b_ms), 2),
            "a_ms_min": round(min(a_ms), 2), "b_ms_min": round(min(b_ms), 2)}


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def speed(paths: dict, qtype: str, tokens: int, rounds: int, threads: int) -> dict[str, Any]:
    """Base + adapter against the merged release, both at ``qtype``, alternating A/B."""
    from clef_gguf import Clef
    from clef_gguf.tools.workload import sized_request

    with Clef.load(paths["base"][qtype], adapters=paths["finetunes"]["a"], threads=threads,
                   state_cache_mb=0) as adapted, \
            Clef.load(paths["merged"][qtype], threads=threads, state_cache_mb=0) as merged:
        request = sized_request(adapted.default_model, tokens)
        adapted.decide(request)  # warm-up both: page in the mmap, reserve the graphs
        merged.decide(request)
        a_ms: list[float] = []
        b_ms: list[float] = []
        sides = {"a": (adapted, a_ms), "b": (merged, b_ms)}
        for r in range(rounds):  # the order flipped every round
            for side in ("ab" if r % 2 == 0 else "ba"):
                model, times = sides[side]
                times.append(timed(partial(model.decide, request)))
        n_tokens = adapted.prepare(request).encoded.n_tokens
    return {"type": qtype, "tokens": n_tokens, "a": "base + adapter a", "b": "merged a",
            **summary(a_ms, b_ms)}


def switching(paths: dict, qtype: str, tokens: int, rounds: int, threads: int) -> dict[str, Any]:
    """One decision through fine-tune a right after one through b (a switch) against one right after
    one through a (none), on distinct prompts of one length; the order flipped every round."""
    from clef_gguf import Clef
    from clef_gguf.tools.workload import records

    tunes = paths["finetunes"]
    with Clef.load(paths["base"][qtype], adapters={"a": tunes["a"], "b": tunes["b"]}, threads=threads,
                   state_cache_mb=0) as clef:
        prompts = iter(records(clef.models["a"], tokens, 4 * rounds + 2))

        def after(previous: str) -> float:
            clef.decide(next(prompts) | {"model": previous})
            return timed(partial(clef.decide, next(prompts) | {"model": "a"}))

        after("b")  # warm-up: both adapters' graphs reserved once
        switched: list[float] = []
        same: list[float] = []
        for r in range(rounds):
            for previous in (("b", "a") if r % 2 == 0 else ("a", "b")):
                (switched if previous == "b" else same).append(after(previous))
    return {"type": qtype, "a": "a right after b", "b": "a right after a",
            "ms_per_switch_median": round(statistics.median(s - t for s, t in zip(switched, same)), 2),
            **summary(switched, same)}


def rss_probe(model: str, adapters: list[str], threads: int) -> dict[str, Any]:
    """(In a child process.) Load ``model`` with the ``adapters``, answer one request through each
    model, report RSS."""
    import psutil

    from clef_gguf import Clef
    from clef_gguf.convert.samples import SAMPLE_REQUESTS

    named = {f"ft{i}": a for i, a in enumerate(adapters)} or None
    with Clef.load(model, adapters=named, threads=threads) as clef:
        for name in clef.models:
            clef.decide(SAMPLE_REQUESTS[0] | {"model": name})
        rss = psutil.Process().memory_info().rss
    return {"fine_tunes": len(adapters), "rss_bytes": rss}


def memory(paths: dict, qtype: str, threads: int) -> dict[str, Any]:
    """RSS with 0, 1 and 2 fine-tunes, each in a fresh process; the step per extra fine-tune."""
    tunes = [str(paths["finetunes"][n]) for n in NAMES]
    rows = []
    for k in range(len(tunes) + 1):
        out = subprocess.run([sys.executable, __file__, "_rss", str(paths["base"][qtype]), str(threads),
                              *tunes[:k]], capture_output=True, text=True, check=True, timeout=600)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    steps = [b["rss_bytes"] - a["rss_bytes"] for a, b in zip(rows, rows[1:])]
    files = {n: sum(p.stat().st_size for p in paths["finetunes"][n].iterdir() if p.is_file()) for n in NAMES}
    return {"type": qtype, "rss_mib": [round(r["rss_bytes"] / MiB, 1) for r in rows],
            "mib_per_extra_fine_tune": [round(s / MiB, 1) for s in steps],
            "fine_tune_dir_mib": {n: round(b / MiB, 2) for n, b in files.items()}}


def probabilities(model: Path, requests: list[dict], threads: int, adapters: Path | None = None) -> list:
    from clef_gguf import Clef

    with Clef.load(model, adapters=adapters, threads=threads, max_length=8192) as clef:
        return [clef.probabilities(r) for r in requests]


def parity(paths: dict, types: list[str], threads: int) -> dict[str, Any]:
    """max |dp| of base TYPE + adapter and of the merge at TYPE, against each other and the f32 merge."""
    from clef_gguf.convert.samples import SAMPLE_REQUESTS
    from clef_gguf.tools.parity import compare

    tune = paths["finetunes"]["a"]
    anchor = probabilities(paths["merged"]["f32"], SAMPLE_REQUESTS, threads)
    out: dict[str, Any] = {}
    for qtype in ["f32", *[t for t in types if t != "f32"]]:
        adapted = probabilities(paths["base"][qtype], SAMPLE_REQUESTS, threads, tune)
        row = {"adapter_vs_merged_f32": compare(adapted, anchor, model="").max_abs_dp}
        if qtype != "f32":
            merged = probabilities(paths["merged"][qtype], SAMPLE_REQUESTS, threads)
            row |= {"adapter_vs_merged_same_type": compare(adapted, merged, model="").max_abs_dp,
                    "merged_vs_merged_f32": compare(merged, anchor, model="").max_abs_dp}
        out[qtype] = {k: float(f"{v:.3g}") for k, v in row.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_rss"]:  # the child process of ``memory``
        print(json.dumps(rss_probe(argv[1], argv[3:], int(argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=Path)
    p.add_argument("--preset", default="small", help="clef-gguf demo preset (default: small, ~110M)")
    p.add_argument("--rank", type=int, default=64, help="LoRA rank (clef-finetune's default: 64)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens of the timed requests")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speed-types", default="f32,Q4_K_M",
                   help="base types timed against the merge, and switched on (comma-separated)")
    p.add_argument("--types", default="Q8_0,Q4_K_M", help="quantized types for the parity numbers")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: speed,switching,memory,parity")
    args = p.parse_args(argv)
    speed_types, types = args.speed_types.split(","), args.types.split(",")
    skip = set(filter(None, args.skip.split(",")))
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    paths = prepare(args.workdir, args.preset, args.rank, args.threads, sorted(set(speed_types + types)))
    report: dict[str, Any] = {"preset": args.preset, "rank": args.rank, "threads": args.threads,
                              "rounds": args.rounds, "prepare_s": round(time.perf_counter() - t0, 1)}
    lora = json.loads((paths["finetunes"]["a"] / "clef-gguf-adapter.json").read_text())["lora"]
    report["lora"] = lora
    if "speed" not in skip:
        report["speed"] = [speed(paths, t, args.tokens, args.rounds, args.threads) for t in speed_types]
    if "switching" not in skip:
        report["switching"] = [switching(paths, t, args.tokens, args.rounds, args.threads) for t in speed_types]
    if "memory" not in skip:
        report["memory"] = memory(paths, speed_types[-1], args.threads)
    if "parity" not in skip:
        report["parity"] = parity(paths, types, args.threads)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    report["ratio_medians"] = {r["type"]: r["ratio_median"] for r in report.get("speed", [])}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

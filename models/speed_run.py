"""The speed probe's own process: for each quant, make its probe tower and time a prefill through it.

    python -m clef_gguf.models.speed_run SPEC.json

``models/speed.py`` starts it (a ggml abort in one quant's quantizer must not take ``pick`` down)
and reads its standard output: one JSON object per line, ``{"quant": ..., ...}`` per quant as it is
measured, and ``{"head_seconds": ...}`` once. The same llama.cpp build, context settings and thread
count as the runtime's (``Tower.load``); the head is the PyTorch joint head at the family's shape.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


# Published files that are another type's mix with token_embd and output at Q8_0 (bartowski's "_L"
# and "_XL"): the probe never multiplies by those two matrices, so they time as their base type.
SHORT = 16  # tokens of the warm-up prefill
SLOW_S = 10.0  # a probe prefill predicted longer than this is timed on SHORT tokens and scaled
CHEAP_S = 1.0  # one predicted shorter than this gets a full-length warm-up and three timed runs
SAME_LAYERS = {"Q6_K_L": "Q6_K", "Q5_K_L": "Q5_K_M", "Q4_K_L": "Q4_K_M", "Q3_K_XL": "Q3_K_L", "Q2_K_L": "Q2_K"}


def _quantize_skeleton(skeleton: Path, out: Path, quant: str, threads: int, workdir: Path) -> None:
    from clef_gguf.convert import imatrix as im
    from clef_gguf.convert import quantize

    if quant not in quantize.QUANT_TYPES:
        raise ValueError(f"{quant} is not a type this llama.cpp build quantizes to")
    spec = {"src": str(skeleton), "dst": str(out), "ftype": quantize.QUANT_TYPES[quant], "threads": threads,
            "output_type": None, "token_embedding_type": None, "imatrix": None, "imatrix_meta": {},
            "keep_layers": None}
    if quant in quantize.NEEDS_IMATRIX:  # the values do not matter to the time: flat weights do
        path = workdir / "uniform.imatrix.gguf"
        if not path.exists():
            im.write(path, im.uniform_for(skeleton))
        spec["imatrix"] = str(path)
    if quantize._child(spec) != 0:
        raise RuntimeError(f"llama.cpp could not quantize the probe skeleton to {quant}")


def _time_tower(path: Path, tokens: int, threads: int, gpu_layers: int, rounds: int) -> tuple[list[float], bool]:
    """(seconds of each timed prefill of ``tokens`` ids, whether they were scaled from short runs).

    A type without fast kernels on this CPU (Q2_0 here: ~170 s for one probe prefill) would spend the
    probe's whole budget: when the warm-up says a full prefill would take over ``SLOW_S``, the probe
    times ``SHORT`` tokens instead and scales linearly (a slow kernel's time is its arithmetic)."""
    from clef_gguf.tower.llama_tower import Tower

    ids = np.random.default_rng(0).integers(300, 512, size=tokens).astype(np.int32)
    short = ids[:SHORT]
    with Tower.load(path, threads=threads, gpu_layers=gpu_layers) as tower:
        start = time.perf_counter()
        tower.hidden_states(short)  # also first-call allocations and kernel selection, off the clock
        estimate = (time.perf_counter() - start) * tokens / len(short)
        if estimate > SLOW_S:
            start = time.perf_counter()
            tower.hidden_states(short)
            return [(time.perf_counter() - start) * tokens / len(short)], True
        if estimate < CHEAP_S:
            # A short prefill: the first full-length decode's own setup (its compute graph and buffers
            # for that batch) is a large part of it, so one more warm-up and three timed runs.
            tower.hidden_states(ids)
            rounds = max(rounds, 3)
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            tower.hidden_states(ids)
            seconds.append(time.perf_counter() - start)
    return seconds, False


def _time_head(config: dict, tokens: int, threads: int, rounds: int) -> float:
    """The joint head at ``config``'s shape on ``tokens`` hidden states: 3 questions and 11 options
    (a noul, a 4-way choice, a 5-level score), as ``clef-gguf bench`` asks."""
    import torch

    from clef_gguf.heads import random_head, synthetic_spans
    from clef_gguf.heads.load import BENCH_COUNTS

    torch.set_num_threads(threads)
    counts = list(BENCH_COUNTS)
    questions, options = synthetic_spans(max(0, tokens - 250), counts)
    pos = options[-1][1]
    head = random_head(config, seed=0).eval()
    hidden = torch.randn(max(tokens, pos), config["hidden_size"])
    rows = torch.randn(sum(e - s for s, e in options), config["hidden_size"])
    seconds = []
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first is a warm-up
            start = time.perf_counter()
            head(hidden, rows, questions, options, counts, [0, 1, 2])
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def main(spec_path: str) -> int:
    from clef_gguf.convert import probe_tower

    spec = json.loads(Path(spec_path).read_text())
    workdir = Path(spec["workdir"])
    skeleton = workdir / "skeleton-bf16.gguf"
    if not skeleton.exists():
        probe_tower.write_skeleton(skeleton, spec["preset"], workdir)

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    if spec.get("head"):
        say({"head_seconds": _time_head(spec["head"], spec["head_tokens"], spec["threads"], 3)})
    for quant in spec["quants"]:
        start = time.perf_counter()
        quantized, probe = workdir / f"skeleton-{quant}.gguf", workdir / f"probe-{quant}.gguf"
        try:
            if quant == "BF16":  # the skeleton's own types: what the converter writes for BF16
                quantized = skeleton
            else:
                _quantize_skeleton(skeleton, quantized, quant, spec["threads"], workdir)
            stored = probe_tower.read_quantized(quantized)
            sources = probe_tower.choose_layers(stored, spec["preset"], spec["probe_layers"])
            written = probe_tower.write_probe(probe, stored, spec["preset"], sources, workdir)
            seconds, scaled = _time_tower(probe, spec["tokens"], spec["threads"],
                                  spec["gpu_layers"].get(quant, 0), spec["rounds"])
            types: dict[str, int] = {}
            for t in stored.values():
                types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
            say({"quant": quant, "probe_seconds": seconds, "scaled": scaled, "sources": sources,
                 "probe_bytes": written["bytes"],
                 "tensor_types": dict(sorted(types.items())), "took": time.perf_counter() - start})
        except Exception as exc:  # noqa: BLE001 - one quant's failure is that quant's row, not the probe's end
            say({"quant": quant, "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            if quantized != skeleton:
                quantized.unlink(missing_ok=True)
            probe.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

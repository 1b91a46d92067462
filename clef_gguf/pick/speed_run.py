"""The speed probe's own process: for each quant, make its probe tower and time prefills through it.

    python -m clef_gguf.pick.speed_run SPEC.json

``clef_gguf/pick/probe_process.py`` starts it (a ggml abort in one quant's quantizer must not take ``pick``
down) and reads its standard output: one JSON object per line, ``{"quant": ..., ...}`` per quant as it is
measured, and ``{"head_seconds": ...}`` once. The same llama.cpp build, context settings and thread
count as the runtime's (``Tower.load``); the head is the PyTorch joint head at the family's shape.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


WARM = 4  # tokens of the warm-up prefill: first-call allocations and kernel selection, off the clock
# Tokens of the system prefix the probe decodes once and keeps: the rest's time does not depend on its
# length, so a short one saves each quant's warm-up (BENCHMARKS.md, the speed probe's settings).
PREFIX = 4
SHORT = 16  # tokens of the short end of the line (``Timed``), timed twice; it also sizes the rest
SLOW_S = 2.0  # a SHORT prefill slower than this is the measurement: a longer one would cost 4x as much
CHEAP_S = 1.0  # a decision-length prefill predicted under this is timed at that length
PROBE_TOKENS = 64  # else the long end of the line
# Timed prefills per length; the line goes through the fastest of each (a slower one is the machine
# busy elsewhere): one alone lets a slow run through. Three at a cheap decision's own length, their
# median: a short prefill's single runs vary most.
RUNS = 2
CHEAP_RUNS = 3


@dataclass(frozen=True)
class Timed:
    """One quant's timed prefills through the probe: ``runs`` of ``tokens`` tokens past the kept prefix,
    and (when a decision is predicted from a line) ``short_runs`` of ``short_tokens`` each."""

    tokens: int
    runs: list[float]
    short_tokens: int | None = None
    short_runs: list[float] = field(default_factory=list)


def _time_tower(path: Path, tokens: int, threads: int, gpu_layers: int, prefix: int) -> Timed:
    """The prefills through the probe that predict a decision of ``tokens`` prompt tokens past the
    system prefix (``speed.tower_seconds`` makes the prediction).

    Each timed prefill is a decision's tower stage as the runtime runs it (``Tower.forward``,
    ``tower/schedule.py``): the system prefix (at most ``PREFIX`` of the runtime's ``prefix`` tokens)
    is decoded once and kept, and every decision after restores it and decodes the rest. A decision
    timed at its own length decodes its state and its rest apart, as the runtime does (half each
    here); on the ~110M model that restore and the second decode were a fifth of a decision.

    Otherwise a prefill's time is a line in its tokens: a part per ``llama_decode`` call and a part per
    token. Through Clef-Flash's four layers on an AVX-512 machine, a K- or IQ-quant's call costs
    0.09-0.17 s whatever its length (its 8- and 16-token prefills take the same time), a type without
    fast kernels (BF16, Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL) under 0.05 s. So the probe times ``SHORT`` and
    ``PROBE_TOKENS`` tokens, each decoded whole, and the line through them predicts a decision of any
    length: its calls' part plus its tokens'. A line through 16 and 128 tokens predicted a 373-token
    decision within 4% of the one through 16 and 64 for every type but IQ2_XXS (7%); scaling a 128-token
    prefill linearly, as the probe did before, over-stated the K- and IQ-quants by 4-13% (64 tokens: by
    a quarter more). The probe's accuracy is measured in BENCHMARKS.md."""
    from clef_gguf.tower.llama_tower import Tower

    prefix = min(prefix, PREFIX)
    ids = np.random.default_rng(0).integers(300, 512, size=prefix + tokens).astype(np.int32)

    def timed(n: int) -> float:
        start = time.perf_counter()
        tower.forward(ids[:prefix + n], prefix, n // 2 if n == tokens else 0, None)  # [prefix][state][rest]
        return time.perf_counter() - start

    with Tower.load(path, threads=threads, gpu_layers=gpu_layers) as tower:
        timed(min(WARM, tokens))  # also decodes the prefix and keeps it, as the runtime's first decision
        short = min(SHORT, tokens)
        first = timed(short)
        if first > SLOW_S:  # no time for more: a type this slow has no per-call part to speak of
            return Timed(short, [first])
        shorts = [first, timed(short)]
        if min(shorts) / short * tokens <= CHEAP_S:  # over-states a longer prefill: its call's part is in it
            timed(tokens)  # a longer prefill's first run touches buffers the short ones did not
            return Timed(tokens, [timed(tokens) for _ in range(CHEAP_RUNS)])
        n = min(tokens, PROBE_TOKENS)
        runs = [timed(n) for _ in range(RUNS)]
        return Timed(n, runs) if n == tokens else Timed(n, runs, short, shorts)


def _time_head(config: dict, tokens: int, threads: int, rounds: int, on_gpu: bool = False) -> float:
    """The joint head at ``config``'s shape on ``tokens`` hidden states: 3 questions and 11 options
    (a noul, a 4-way choice, a 5-level score), as ``clef-gguf bench`` asks; ``on_gpu``: where the runtime
    puts it beside a GPU tower (``head_device=auto``), when torch sees CUDA."""
    import torch

    device = torch.device("cuda" if on_gpu and torch.cuda.is_available() else "cpu")

    from clef_gguf.convert.synthetic.head import BENCH_COUNTS, synthetic_spans
    from clef_gguf.heads import JointSchemaHead, check_config

    torch.set_num_threads(threads)
    counts = list(BENCH_COUNTS)
    questions, options = synthetic_spans(max(0, tokens - 250), counts)
    pos = options[-1][1]
    # torch's own initialisation: the values do not matter to time, and random_head's float64 draws
    # took 3 s of the probe at Clef-Flash's shape
    head = JointSchemaHead(**check_config(config, source="config")).eval().to(device)
    hidden = torch.randn(max(tokens, pos), config["hidden_size"])  # host arrays, as the tower hands them
    rows = torch.randn(sum(e - s for s, e in options), config["hidden_size"])
    seconds = []
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first is a warm-up
            start = time.perf_counter()
            head(hidden, rows, questions, options, counts, [0, 1, 2]).cpu()  # the logits back: a sync
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def _time_picture(size: int, out_hidden: int, threads: int, workdir: Path) -> tuple[int, float]:
    """(prompt tokens one ``size`` x ``size`` picture adds, seconds of the vision tower on it): Clef-Flash's
    processor settings and vision tower shape (``convert.synthetic.big``), random weights, the default engine."""
    import PIL.Image
    import torch

    from clef_gguf.convert.synthetic.big import FLASH_PROCESSORS, FLASH_VISION
    from clef_gguf.media.config import load_processor_config
    from clef_gguf.media.placeholders import token_counts
    from clef_gguf.media.processor import preprocess_images
    from clef_gguf.vision import VisionConfig, VisionTower

    torch.set_num_threads(threads)
    for name, settings in FLASH_PROCESSORS.items():
        (workdir / name).write_text(json.dumps(settings), encoding="utf-8")
    processor = load_processor_config(workdir)
    assert processor is not None  # written just above
    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    batch = preprocess_images([PIL.Image.fromarray(pixels)], processor.image, ["picture"])
    tower = VisionTower.random(VisionConfig(**FLASH_VISION, out_hidden_size=out_hidden), threads=threads)
    tower.embed(batch.pixel_values, batch.grid_thw)  # first-call allocations, off the clock
    start = time.perf_counter()
    tower.embed(batch.pixel_values, batch.grid_thw)
    seconds = time.perf_counter() - start
    # <|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|> (media/placeholders.py)
    return token_counts(batch.grid_thw, FLASH_VISION["spatial_merge_size"])[0] + 2, seconds


def main(spec_path: str) -> int:
    from clef_gguf.convert import probe_tower

    spec = json.loads(Path(spec_path).read_text())
    workdir = Path(spec["workdir"])
    skeleton = workdir / "skeleton-bf16.gguf"
    if not skeleton.exists():
        probe_tower.write_skeleton(skeleton, spec["preset"], workdir)

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    tokens, head_tokens = spec["tokens"], spec["head_tokens"]
    # A process started again after a quant took the last one down has these from the first.
    picture_tokens = spec.get("picture_tokens")
    if spec.get("picture") and picture_tokens is None:
        picture_tokens, picture_seconds = _time_picture(spec["picture"], spec["head"]["hidden_size"],
                                                        spec["threads"], workdir)
        say({"picture_tokens": picture_tokens, "picture_seconds": picture_seconds})
    if picture_tokens:  # the picture's tokens go through the tower and the head with the text's
        tokens, head_tokens = tokens + picture_tokens, head_tokens + picture_tokens
    if not spec.get("head_known"):
        on_gpu = any(n != 0 for n in spec["gpu_layers"].values())
        say({"head_seconds": _time_head(spec["head"], head_tokens, spec["threads"], 3, on_gpu)})
    skeleton_tensors = probe_tower.read_tensors(skeleton)
    whole = spec["probe_layers"] == spec["layers"]  # a small tower, probed whole: real rows
    for quant in spec["quants"]:
        start = time.perf_counter()
        probe = workdir / f"probe-{quant}.gguf"
        try:
            if quant == "BF16":  # the skeleton's own types, what the converter writes for BF16
                stored = skeleton_tensors if whole else probe_tower.retyped(skeleton_tensors, {})
            elif quant in probe_tower.NVFP4_GGUF:  # a checkpoint's codes re-encoded: no quantizer's mix
                stored = probe_tower.nvfp4_retyped(skeleton_tensors, spec["preset"])
            elif whole:
                stored = probe_tower.quantized(skeleton, quant, workdir, spec["threads"])
            else:
                stored = probe_tower.retyped(skeleton_tensors,
                                             probe_tower.planned_types(skeleton, quant, spec["threads"]))
            sources = probe_tower.choose_layers(stored, spec["preset"], spec["probe_layers"])
            written = probe_tower.write_probe(probe, stored, spec["preset"], sources, workdir,
                                              nvfp4_a16=probe_tower.NVFP4_GGUF.get(quant) is False)
            got = _time_tower(probe, tokens, spec["threads"], spec["gpu_layers"].get(quant, 0), spec["prefix"])
            types: dict[str, int] = {}
            for t in stored.values():
                types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
            say({"quant": quant, "probe_tokens": got.tokens, "probe_runs": got.runs,
                 "short_tokens": got.short_tokens, "short_runs": got.short_runs, "sources": sources,
                 "probe_bytes": written["bytes"],
                 "tensor_types": dict(sorted(types.items())), "took": time.perf_counter() - start})
        except Exception as exc:  # noqa: BLE001 - one quant's failure is that quant's row, not the probe's end
            say({"quant": quant, "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            probe.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

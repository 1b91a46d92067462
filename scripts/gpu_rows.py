"""The rows of the GPU check (``scripts/gpu_check.py`` runs each in a process of its own, in this order).

Each row is ``fn(work, dry) -> dict`` with a ``status`` ("passed", "failed" or "measured": a number with
no pass mark) and its data. ``dry`` runs the same code on the CPU at the tiny shapes (the test suite's
``gpu-check.sh --dry-run``), so a GPU run is never spent on a typo. Models are built once per run in
``work`` and shared by the rows that need them. Targets (issue "Decisions at the GPU's speed") are reported,
not asserted: the head under 2 ms and the tower within 25 ms at 466 tokens, 60 decisions/s at 64 clients.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

TOKENS = (466, 1986)  # the peers' and gpu.md's lengths
DRY_TOKENS = (64, 160)  # the dry run's: the tiny model's code paths, in seconds
REPEAT = 5
# bf16 backend vs bf16 reference: the same weights through the same layers, so only the order of bf16
# sums may differ (kernels chosen by shape); a wrong kernel or wiring moves answers by far more
BF16_BAR = 1e-2
FAST_FP32_BAR = 1e-3  # fp32 on the GPU through flash-linear-attention against the CPU's reference code
TARGETS = {"head_ms": 2.0, "tower_ms_466": 25.0, "decisions_per_s_64": 60.0, "pick_ratio": (0.75, 1.25)}
REQUEST = {"state": "Invoice INV-7 for $1,250.00 is 40 days past due.",
           "questions": {"overdue": {"type": "noul"},
                         "action": {"type": "choice", "criteria": {"remind": None, "escalate": None}},
                         "risk": {"type": "score", "criteria": ["low", "medium", "high"]}}}


def _gpu(dry: bool) -> dict[str, Any]:
    """The placement a row asks for: everything on the GPU, or (dry run) on the CPU."""
    return {"gpu_layers": 0, "head_device": "cpu"} if dry else {"gpu_layers": "all", "head_device": "auto"}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def _once(work: Path, name: str, make: Callable[[Path], Any]) -> Path:
    """``work/name``, made by ``make`` the first time a row asks for it in this run."""
    out = work / name
    if not (out / "clef-gguf.json").is_file():
        make(out)
    return out


def tiny_model(work: Path) -> Path:
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release

    return _once(work, "tiny-f32", lambda out: convert_release(build_release(work / "tiny-release"), out))


def tokens(dry: bool) -> tuple[int, int]:
    return DRY_TOKENS if dry else TOKENS


def big_model(work: Path, dry: bool, outtype: str = "Q4_K_M", layers: int | None = None) -> Path:
    """A random model at Clef-Flash's 9B shape (``layers``: fewer blocks; dry: the tiny test shape)."""
    from clef_gguf.convert.synthetic.big import build_random_model

    preset = "tiny256" if dry else "flash9b"
    layers = None if dry else layers
    return _once(work, f"{preset}-{layers or 'all'}-{outtype}",
                 lambda out: build_random_model(out, preset=preset, outtype=outtype, layers=layers))


# ------------------------------------------------------------------------------------------------ rows

def preflight(work: Path, dry: bool) -> dict:
    import llama_cpp
    import torch

    import clef_gguf
    from clef_gguf.models import machine

    found: dict[str, Any] = {}
    for name in ("transformers", "compressed_tensors", "fastapi", "uvicorn", "gguf", "fla"):
        try:
            found[name] = getattr(__import__(name), "__version__", "?")
        except ImportError as exc:
            found[name] = f"missing: {exc}"
    data = {"clef_gguf": clef_gguf.__file__, "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "llama_cpp": llama_cpp.__version__, "llama_backends": list(machine.llama_backends()),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"), "imports": found}
    ok = dry or (data["cuda"] and bool(data["llama_backends"]))
    missing = [k for k in ("fastapi", "uvicorn", "gguf") if str(found[k]).startswith("missing")]
    return {"status": "passed" if ok and not missing else "failed", **data,
            **({"reason": f"missing {missing}"} if missing else {})}


def parity(work: Path, dry: bool) -> dict:
    """The tiny f32 model: tower and head on the GPU against both on the CPU, and on the GPU the sample
    prompts packed in one decode against one at a time (bar 1e-5 each)."""
    from clef_gguf import Clef
    from clef_gguf.convert.samples import SAMPLE_REQUESTS

    model = tiny_model(work)
    probs = {}
    for name, where in (("gpu", _gpu(dry)), ("cpu", {"gpu_layers": 0, "head_device": "cpu"})):
        with Clef.load(model, state_cache_mb=0, **where) as clef:
            probs[name] = [np.concatenate(clef.probabilities(r)) for r in SAMPLE_REQUESTS]
            placed = {"gpu_layers": clef.info["gpu_layers"], "head_device": clef.info["head_device"]}
            if name == "gpu":
                encoded = [clef.prepare(r).encoded for r in SAMPLE_REQUESTS]
                prompts = [(e.ids, e.prefix_tokens, e.state_tokens) for e in encoded]
                one, packed = (clef.tower.forward_many(prompts, None, pack=k) for k in (1, len(prompts)))
                packed_dp = max(float(np.abs(clef.flat_probabilities(e, a[0]) - clef.flat_probabilities(e, b[0])).max())
                                for e, a, b in zip(encoded, one, packed))
    dp = max(float(np.abs(a - b).max()) for a, b in zip(probs["gpu"], probs["cpu"]))
    ok = dp <= 1e-5 and packed_dp <= 1e-5
    return {"status": "passed" if ok else "failed", "max_abs_dp": dp, "packed_vs_one_max_abs_dp": packed_dp,
            "bar": 1e-5, "placed": placed}


def _latency(model: Path, dry: bool, lengths: tuple[int, ...] | None = None, **load: Any) -> dict:
    from clef_gguf import Clef
    from clef_gguf.tools.bench import sized_request

    out: dict[str, Any] = {}
    with Clef.load(model, state_cache_mb=0, max_length=4096, **_gpu(dry), **load) as clef:
        for n in lengths or tokens(dry):
            request = sized_request(clef, n)
            clef.decide(request)  # warm-up: kernels chosen, buffers made, the prefix kept
            stages: dict[str, list[float]] = {}
            for _ in range(2 if dry else REPEAT):
                _, timings = clef.run(clef.prepare(request))
                for stage in ("tower", "lexical", "head", "total"):
                    stages.setdefault(stage, []).append(timings[stage])
            out[str(n)] = {"tokens": clef.prepare(request).encoded.n_tokens,
                           **{f"{k}_ms": _spread(v) for k, v in stages.items()}}
    return out


def latency(work: Path, dry: bool) -> dict:
    """One decision at ~466 and ~1,986 tokens on the full-size model (9B shape, Q4_K_M), per stage."""
    data = _latency(big_model(work, dry), dry)
    first = data[str(tokens(dry)[0])]
    return {"status": "measured", "by_tokens": data, "targets": TARGETS,
            "head_ms_466": first["head_ms"]["median"], "tower_ms_466": first["tower_ms"]["median"]}


# tower types x attention x decode chunk; every time through a 4-layer model scales to 32 layers (x 8)
KERNEL_TYPES = ("Q4_K_M", "Q8_0", "bf16", "f16")
KERNEL_SETTINGS = (("default", 512), ("flash-off", 512), ("flash-on", 512), ("default", 2048))


def kernels(work: Path, dry: bool) -> dict:
    """The kernel matrix on a 4-layer model of the 9B shape: MMQ for quantized files, cuBLAS for
    bf16/f16, flash attention, the decode chunk. The fastest setting per type is what
    ``tower/kernel_table.py`` is given to choose from."""
    from clef_gguf.tower.llama_tower import Tower
    from clef_gguf.formats.files import from_directory

    rows = []
    for outtype in KERNEL_TYPES:
        tower_file = from_directory(big_model(work, dry, outtype, layers=4)).tower
        for attention, n_batch in KERNEL_SETTINGS:
            lengths = tokens(dry)
            ids = np.random.default_rng(0).integers(300, 500, size=max(lengths)).astype(np.int32)
            try:
                with Tower.load(tower_file, gpu_layers=0 if dry else -1, n_batch=n_batch, n_ctx=4096,
                                attention=attention) as tower:
                    tower.hidden_states(ids[:64])  # warm-up
                    for n in lengths:
                        times = []
                        for _ in range(2 if dry else REPEAT):
                            start = time.perf_counter()
                            tower.hidden_states(ids[:n])
                            times.append((time.perf_counter() - start) * 1e3)
                        rows.append({"weights": outtype, "attention": attention, "n_batch": n_batch, "tokens": n,
                                     "ms_4_layers": _spread(times),
                                     "ms_32_layers_est": round(statistics.median(times) * (1 if dry else 8), 2)})
            except Exception as exc:  # noqa: BLE001 - a setting this build refuses is a finding
                rows.append({"weights": outtype, "attention": attention, "n_batch": n_batch,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
    from clef_gguf.tower.kernel_table import Measured, choose

    measured = [Measured(r["weights"], "cpu" if dry else "gpu", r["attention"], r["n_batch"], r["tokens"],
                         r["ms_4_layers"]["median"]) for r in rows if "error" not in r]
    chosen = {f"{w}/{d}": {"attention": c.attention, "n_batch": c.n_batch, "gain": c.gain}
              for (w, d), c in choose(measured).items()}
    return {"status": "measured", "rows": rows, "chosen": chosen}


def throughput(work: Path, dry: bool) -> dict:
    """Decisions/s: 64 distinct ~500-token requests through decide_many at pack 1, 4 and 16, and
    through ``serve`` (bench-server, state cache off) at 1, 16 and 64 clients."""
    from clef_gguf import Clef
    from clef_gguf.core.children import module_command
    from clef_gguf.tools.bench import sized_request

    model = big_model(work, dry)
    count = 6 if dry else 64
    packs = {}
    with Clef.load(model, state_cache_mb=0, max_length=4096, **_gpu(dry)) as clef:
        base = sized_request(clef, 100 if dry else 500)
        requests = [{**base, "state": f"{i}: {base['state']}"} for i in range(count)]
        list(clef.decide_many(requests[:2]))  # warm-up
        for pack in (1, 4, 16):
            start = time.perf_counter()
            answers = list(clef.decide_many(requests, pack=pack))
            assert not any("error" in a for a in answers), answers[:1]
            packs[str(pack)] = round(count / (time.perf_counter() - start), 2)
    levels = (1, 4) if dry else (1, 16, 64)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    proc = subprocess.run(module_command("clef_gguf.cli", "bench-server", "--model", str(model), "--json",
                                         "--state-cache-mb", "0", "--requests", str(count),
                                         "--concurrency", *map(str, levels)),
                          capture_output=True, text=True, env=env, timeout=1800)
    served = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
    return {"status": "measured" if proc.returncode == 0 else "failed", "decide_many_per_s": packs,
            "serve": served, "targets": TARGETS}


def pick(work: Path, dry: bool) -> dict:
    """pick's probe (its layers placed as the runtime would) against a decision measured on the full model."""
    from clef_gguf import Clef
    from clef_gguf.core.cpus import available_cpus
    from clef_gguf.core.limits import SYSTEM_PREFIX_TOKENS
    from clef_gguf.pick import speed
    from clef_gguf.tools.bench import sized_request

    model = big_model(work, dry)
    with Clef.load(model, state_cache_mb=0, **_gpu(dry)) as clef:
        request = sized_request(clef, 100 if dry else speed.DEFAULT_TOKENS)
        encoded = clef.prepare(request).encoded
        clef.decide(request)
        measured = []
        for _ in range(3):
            start = time.perf_counter()
            clef.decide(request)
            measured.append(time.perf_counter() - start)
    decoded = encoded.n_tokens - encoded.prefix_tokens
    table = speed.measure("clef-flash", ["Q4_K_M"], tokens=decoded + SYSTEM_PREFIX_TOKENS, threads=available_cpus(),
                          gpu_layers={"Q4_K_M": 0 if dry else -1}, reprobe=True, preset="tiny256" if dry else None)
    row = table.quants["Q4_K_M"]
    ratio = round(row.seconds / statistics.median(measured), 3) if row.seconds else None
    lo, hi = TARGETS["pick_ratio"]
    return {"status": "measured" if ratio else "failed", "measured_s": _spread(measured), "predicted_s": row.seconds,
            "ratio": ratio, "within_25pct": ratio is not None and lo <= ratio <= hi, "probe_s": table.took_seconds,
            "error": row.error}


def nvfp4(work: Path, dry: bool) -> dict:
    """NVFP4 three ways at ~466 tokens on a 0.8B-shaped release (dry: tiny): the NVFP4 GGUF through
    llama.cpp, Q4_K_M, and the PyTorch backend; then the backend like for like: fp32 on the GPU against
    fp32 on the CPU (NVFP4A16, bar 1e-5, or ``FAST_FP32_BAR`` through fla), and bf16 on the GPU against
    transformers' own model on the same dequantized weights in bf16 there (``tower.nvfp4.reference``;
    bar ``BF16_BAR``)."""
    from clef_gguf import Clef
    from clef_gguf.convert.nvfp4 import quantize_release
    from clef_gguf.convert.nvfp4_to_gguf import convert_checkpoint
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.samples import SAMPLE_REQUESTS
    from clef_gguf.convert.synthetic.tiny import build_release

    preset = "tiny" if dry else "qwen08b"
    release = build_release(work / f"{preset}-release", preset=preset)
    checkpoint = quantize_release(release, work / f"{preset}-nvfp4a16", scheme="nvfp4a16")
    models = {"nvfp4-gguf": convert_checkpoint(checkpoint, work / f"{preset}-nvfp4-gguf"),
              "Q4_K_M": convert_release(release, work / f"{preset}-q4", outtype="Q4_K_M"),
              "pytorch-nvfp4a16": checkpoint}
    first = tokens(dry)[0]
    times = {name: _latency(path, dry, (first,))[str(first)]["total_ms"] for name, path in models.items()}
    probs, kernels = {}, {}
    for name, where in (("gpu", _gpu(dry)), ("cpu", {"gpu_layers": 0, "head_device": "cpu"})):
        with Clef.load(checkpoint, state_cache_mb=0, nvfp4_dtype="fp32", **where) as clef:
            probs[name] = [np.concatenate(clef.probabilities(r)) for r in SAMPLE_REQUESTS]
            kernels[name] = clef.tower.linear_kernels
    dp = max(float(np.abs(a - b).max()) for a, b in zip(probs["gpu"], probs["cpu"]))
    # the reference code on both sides: the same fp32 math (bar 1e-5); another kernel on the GPU (fla's
    # Triton, whose fp32 dot products may run in TF32) is another computation: FAST_FP32_BAR
    same = kernels["gpu"] == kernels["cpu"]
    bar = 1e-5 if same else FAST_FP32_BAR
    bf16 = _nvfp4_bf16_vs_reference(release, checkpoint, dry)
    ok = dp <= bar and bf16["max_abs_dp"] <= BF16_BAR
    return {"status": "passed" if ok else "failed", "preset": preset, "total_ms": times, "tokens": first,
            "pytorch_fp32_gpu_vs_cpu_max_abs_dp": dp, "fp32_bar": bar, "linear_kernels": kernels,
            "pytorch_bf16_vs_reference_bf16": bf16, "pytorch_decisions_per_s": _nvfp4_packing(checkpoint, dry)}


def _nvfp4_bf16_vs_reference(release: Path, checkpoint: Path, dry: bool) -> dict[str, float]:
    """The backend in bf16 against transformers' model in bf16 on the same dequantized weights, on the
    same device, over the sample requests: max |dp| (both hidden states through our head) and the hidden
    states' max |difference| relative to their largest value."""
    import torch

    from clef_gguf import Clef
    from clef_gguf.convert.samples import SAMPLE_REQUESTS
    from clef_gguf.formats import files
    from clef_gguf.tower.nvfp4 import reference
    from clef_gguf.tower.nvfp4.checkpoint import Checkpoint

    ref = reference.reference_model(release, Checkpoint(checkpoint / files.CHECKPOINT_CONFIG),
                                    dtype=torch.bfloat16, device="cpu" if dry else "cuda")
    worst_dp = worst_hidden = 0.0
    with Clef.load(checkpoint, state_cache_mb=0, nvfp4_dtype="bf16", **_gpu(dry)) as clef:
        for request in SAMPLE_REQUESTS:
            enc = clef.prepare(request).encoded
            ours, theirs = clef.tower.hidden_states(enc.ids), reference.reference_hidden_states(ref, enc.ids)
            p = [clef.flat_probabilities(enc, h) for h in (ours, theirs)]
            worst_dp = max(worst_dp, float(np.abs(p[0] - p[1]).max()))
            worst_hidden = max(worst_hidden, float(np.abs(ours - theirs).max() / max(1.0, np.abs(theirs).max())))
    return {"max_abs_dp": worst_dp, "hidden_max_rel": worst_hidden}


def _nvfp4_packing(checkpoint: Path, dry: bool) -> dict[str, float]:
    """The PyTorch backend's decisions/s (its default dtype) over distinct ~466-token requests, one
    prompt per forward against its packing policy (16 per forward on CUDA; the dry run packs 4)."""
    from clef_gguf import Clef
    from clef_gguf.tools.bench import sized_request

    count = 6 if dry else 32
    rates = {}
    with Clef.load(checkpoint, state_cache_mb=0, **_gpu(dry)) as clef:
        base = sized_request(clef, 100 if dry else TOKENS[0])
        requests = [{**base, "state": f"{i}: {base['state']}"} for i in range(count)]
        list(clef.decide_many(requests[:2]))  # warm-up
        for name, pack in (("pack_1", 1), ("packed", 4 if dry else None)):
            start = time.perf_counter()
            answers = list(clef.decide_many(requests, pack=pack))
            assert not any("error" in a for a in answers), answers[:1]
            rates[name] = round(count / (time.perf_counter() - start), 2)
    return rates


ROWS: tuple[tuple[str, Callable[[Path, bool], dict], int], ...] = (
    # name, function, seconds it takes on an H200 (a guess until measured: the orchestrator skips a row
    # that cannot start with this much time left), in priority order
    ("preflight", preflight, 20),
    ("parity", parity, 30),
    ("latency", latency, 240),
    ("kernels", kernels, 200),
    ("throughput", throughput, 120),
    ("pick", pick, 60),
    ("nvfp4", nvfp4, 120),
)

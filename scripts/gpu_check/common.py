"""The GPU check's common rows, each ``fn(work, dry) -> dict`` (``rows`` puts them in priority order).

A row returns a ``status`` ("passed", "failed" or "measured": a number with no pass mark) and its data;
every measurement is also ``record``-ed the moment it is taken (one JSON line on stdout), so a row the
deadline cuts off keeps what it measured. ``dry`` runs the same code on the CPU at the tiny shapes (the
test suite's ``gpu-check.sh --dry-run``), so a GPU run is never spent on a typo. Models are written once
per run in ``work`` directly in their type (``convert.synthetic.tiled``: the 9B Q4_K_M in ~20 s) and
shared by the rows that need them (``nvfp4`` uses the helpers here too). Every bar and target is
``clef_gguf.core.limits``': the targets (``GPU_TARGETS``: the head under 2 ms and the tower within 25 ms
at 466 tokens, 60 decisions/s at 64 clients, pick within 25%) are reported, not asserted.
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

from clef_gguf.core.limits import GPU_MAX_DP, GPU_PARITY_FAIL, GPU_PARITY_GOAL, GPU_TARGETS
from gpu_check.report import record

DRY_TOKENS = (64, 160)  # the dry run's: the tiny model's code paths, in seconds
REPEAT = 5
SERVE_CLIENTS = 64
SERVE_TOKENS = 500


def placement(dry: bool) -> dict[str, Any]:
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


def tokens(dry: bool) -> tuple[int, ...]:
    """The prompt lengths measured: ``clef-gguf tune``'s default ``--lengths`` (its public
    ``DEFAULT_LENGTHS``: the targets' 466 and 1,986), or the dry run's."""
    from clef_gguf.tools.tune import DEFAULT_LENGTHS

    return DRY_TOKENS if dry else DEFAULT_LENGTHS


def big_model(work: Path, dry: bool, outtype: str = "Q4_K_M", layers: int | None = None) -> Path:
    """A random model at Clef-Flash's 9B shape (``layers``: fewer blocks; dry: the tiny test shape)."""
    from clef_gguf.convert.synthetic.big import build_random_model

    preset = "tiny256" if dry else "flash9b"
    layers = None if dry else layers
    return _once(work, f"{preset}-{layers or 'all'}-{outtype}",
                 lambda out: build_random_model(out, preset=preset, outtype=outtype, layers=layers))


def missing_distributions(root: str = "clef-gguf", extras: tuple[str, ...] = ("nvfp4",),
                          also: tuple[str, ...] = ("httpx",)) -> list[str]:
    """What ``root`` with ``extras`` (and ``also``: bench-server's client) needs, transitively, that this
    Python lacks or has at a version outside the range asked: the bundle installs with ``--no-deps``."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError as exc:
        return [f"packaging ({exc})"]
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras), *((name, ()) for name in also)]
    seen: set[str] = set()
    missing: list[str] = []
    while todo:
        name, wanted = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            missing.append(f"{name} (not installed)")
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                continue
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                missing.append(f"{req.name} (not installed; {name} needs it)")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                missing.append(f"{req.name} {version} (not {req.specifier}; {name} needs it)")
            todo.append((req.name, tuple(req.extras)))
    return sorted(set(missing))


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
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"), "imports": found,
            "offline": {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}}
    for key in ("cuda", "device", "llama_backends"):
        record(key, data[key])
    ok = dry or (data["cuda"] and bool(data["llama_backends"]))
    missing = missing_distributions()  # every dependency, as the bundle's --no-deps install left them
    data["distributions_missing"] = record("distributions_missing", missing)
    return {"status": "passed" if ok and not missing else "failed", **data,
            **({"reason": f"missing {missing}"} if missing else {})}


def _compare(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, Any]:
    """max |dp| and whether every question's argmax agrees, over per-request probability lists."""
    dp = max(float(np.abs(x - y).max()) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    same = all(int(np.argmax(x)) == int(np.argmax(y)) for ra, rb in zip(a, b) for x, y in zip(ra, rb) if x.size > 1)
    return {"max_abs_dp": dp, "argmax_agrees": same}


def parity(work: Path, dry: bool) -> dict:
    """The tiny f32 model, GPU vs CPU: the tower on the GPU with the head on the GPU, and with the head
    on the CPU, against both on the CPU; and on the GPU the sample prompts packed in one decode against
    one at a time. The goal (``limits.GPU_PARITY_GOAL``) is reported; a failure is past
    ``limits.GPU_PARITY_FAIL`` or an argmax that changes."""
    from clef_gguf import Clef
    from clef_gguf.convert.samples import SAMPLE_REQUESTS

    model = tiny_model(work)
    gpu = placement(dry)
    sides = {"cpu": {"gpu_layers": 0, "head_device": "cpu"}, "head_on_gpu": gpu,
             "head_on_cpu": {**gpu, "head_device": "cpu"}}
    probs, placed = {}, {}
    for name, where in sides.items():
        with Clef.load(model, state_cache_mb=0, **where) as clef:
            probs[name] = [[np.asarray(p) for p in clef.probabilities(r)] for r in SAMPLE_REQUESTS]
            placed[name] = {"gpu_layers": clef.info["gpu_layers"], "head_device": clef.info["head_device"]}
            if name == "head_on_gpu":
                encoded = [clef.prepare(r).encoded for r in SAMPLE_REQUESTS]
                prompts = [(e.ids, e.prefix_tokens, e.state_tokens) for e in encoded]
                one, packed = (clef.tower.forward_many(prompts, None, pack=k) for k in (1, len(prompts)))
                packed_cmp = _compare([[clef.flat_probabilities(e, a[0])] for e, a in zip(encoded, one)],
                                      [[clef.flat_probabilities(e, b[0])] for e, b in zip(encoded, packed)])
    out = {name: record(name, _compare(probs[name], probs["cpu"])) for name in ("head_on_gpu", "head_on_cpu")}
    out["packed_vs_one"] = record("packed_vs_one", packed_cmp)
    worst = max(v["max_abs_dp"] for v in out.values())
    ok = worst <= GPU_PARITY_FAIL and all(v["argmax_agrees"] for v in out.values())
    return {"status": "passed" if ok else "failed", **out, "max_abs_dp": worst, "goal": GPU_PARITY_GOAL,
            "within_goal": worst <= GPU_PARITY_GOAL, "fails_past": GPU_PARITY_FAIL, "placed": placed}


def latency_by_length(model: Path, dry: bool, lengths: tuple[int, ...] | None = None, key: str = "",
                      **load: Any) -> dict:
    """Per stage, the spread of one decision at each length (default: ``tokens``), each recorded."""
    from clef_gguf import Clef
    from clef_gguf.tools.workload import sized_request

    out: dict[str, Any] = {}
    with Clef.load(model, state_cache_mb=0, max_length=4096, **placement(dry), **load) as clef:
        for n in lengths or tokens(dry):
            request = sized_request(clef, n)
            clef.decide(request)  # warm-up: kernels chosen, buffers made, the prefix kept
            stages: dict[str, list[float]] = {}
            for _ in range(2 if dry else REPEAT):
                _, timings = clef.run(clef.prepare(request))
                for stage in ("tower", "lexical", "head", "total"):
                    stages.setdefault(stage, []).append(timings[stage])
            out[str(n)] = record(f"{key}{n}", {"tokens": clef.prepare(request).encoded.n_tokens,
                                               **{f"{k}_ms": _spread(v) for k, v in stages.items()}})
    return out


def latency(work: Path, dry: bool) -> dict:
    """One decision at ~466 and ~1,986 tokens on the full-size model (9B shape, Q4_K_M), per stage."""
    t0 = time.perf_counter()
    model = big_model(work, dry)
    record("model_write_s", round(time.perf_counter() - t0, 1))
    data = latency_by_length(model, dry)
    first = data[str(tokens(dry)[0])]
    return {"status": "measured", "by_tokens": data, "targets": GPU_TARGETS,
            "head_ms_466": first["head_ms"]["median"], "tower_ms_466": first["tower_ms"]["median"]}


def throughput(work: Path, dry: bool) -> dict:
    """Decisions/s: distinct ~500-token requests through decide_many at pack 1, 4 and 16, then
    ``SERVE_CLIENTS`` concurrent clients sending ~500-token requests through ``serve`` (bench-server,
    state cache off): decisions/s and p50/p95, each answer held to ``limits.GPU_MAX_DP`` of one at a time
    on a GPU (byte-identical on the CPU: bench-server decides from the server's placement)."""
    from clef_gguf import Clef
    from clef_gguf.core.children import module_command
    from clef_gguf.tools.workload import sized_request

    model = big_model(work, dry)
    count = 6 if dry else SERVE_CLIENTS
    packs = {}
    with Clef.load(model, state_cache_mb=0, max_length=4096, **placement(dry)) as clef:
        base = sized_request(clef, 100 if dry else SERVE_TOKENS)
        requests = [{**base, "state": f"{i}: {base['state']}"} for i in range(count)]
        list(clef.decide_many(requests[:2]))  # warm-up
        for pack in (1, 4, 16):
            start = time.perf_counter()
            answers = list(clef.decide_many(requests, pack=pack))
            if any("error" in a for a in answers):
                return {"status": "failed", "reason": f"pack {pack}: {answers[0]}"[:500], "decide_many_per_s": packs}
            packs[str(pack)] = record(f"decide_many_pack_{pack}_per_s", round(count / (time.perf_counter() - start), 2))
    levels = (1, 4) if dry else (1, 16, SERVE_CLIENTS)
    cmd = module_command("clef_gguf.cli", "bench-server", "--model", str(model), "--json", "--state-cache-mb", "0",
                         "--requests", str(count), "--tokens", str(100 if dry else SERVE_TOKENS),
                         "--concurrency", *map(str, levels))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    served = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
    record("serve", served)
    return {"status": "measured" if proc.returncode == 0 else "failed", "decide_many_per_s": packs,
            "serve": served, "tolerance": 0.0 if dry else GPU_MAX_DP, "targets": GPU_TARGETS}


def pick(work: Path, dry: bool) -> dict:
    """pick's probe (its layers placed as the runtime would) against a decision measured on the full model."""
    from clef_gguf import Clef
    from clef_gguf.core.cpus import available_cpus
    from clef_gguf.core.limits import SYSTEM_PREFIX_TOKENS
    from clef_gguf.pick import speed
    from clef_gguf.tools.workload import sized_request

    model = big_model(work, dry)
    with Clef.load(model, state_cache_mb=0, **placement(dry)) as clef:
        request = sized_request(clef, 100 if dry else speed.DEFAULT_TOKENS)
        encoded = clef.prepare(request).encoded
        clef.decide(request)
        measured = []
        for _ in range(3):
            start = time.perf_counter()
            clef.decide(request)
            measured.append(time.perf_counter() - start)
    record("measured_s", _spread(measured))
    decoded = encoded.n_tokens - encoded.prefix_tokens
    table = speed.measure("clef-flash", ["Q4_K_M"], tokens=decoded + SYSTEM_PREFIX_TOKENS, threads=available_cpus(),
                          gpu_layers={"Q4_K_M": 0 if dry else -1}, reprobe=True, preset="tiny256" if dry else None)
    row = table.quants["Q4_K_M"]
    ratio = round(row.seconds / statistics.median(measured), 3) if row.seconds else None
    record("predicted_s", row.seconds)
    lo, hi = GPU_TARGETS["pick_ratio"]
    return {"status": "measured" if ratio else "failed", "measured_s": _spread(measured), "predicted_s": row.seconds,
            "ratio": ratio, "within_25pct": ratio is not None and lo <= ratio <= hi, "probe_s": table.took_seconds,
            "error": row.error}


def kernels(work: Path, dry: bool) -> dict:
    """``clef-gguf tune --model M --json`` on the 9B-shape Q4_K_M model: the settings (threads, decode
    chunk, flash attention, pack size, the head's device and dtype) measured on this GPU, and the winners
    it keeps for this machine."""
    from clef_gguf.core.children import module_command

    model = big_model(work, dry)
    cmd = module_command("clef_gguf.cli", "tune", "--model", str(model), "--json",
                         "--gpu-layers", "0" if dry else "all")
    if dry:
        cmd += ["--lengths", ",".join(map(str, DRY_TOKENS)), "--rounds", "2", "--only", "flash_attention"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"status": "failed", "reason": f"tune exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    return {"status": "measured", "tune": record("tune", json.loads(proc.stdout))}

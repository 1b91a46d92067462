"""Responses of the demo models to a fixed set of requests, through the public Python API only, so
that a change of structure can be checked to leave every answer byte-identical.

    python scripts/golden.py tests/golden/responses.json           # write (before the change)
    python scripts/golden.py --check tests/golden/responses.json   # compare (after it)

The file records the kernel path that wrote it (``kernel_path``: the CPU features llama.cpp was
compiled with, torch's CPU capability, both versions). On that path ``--check`` wants the same bytes.
On another path (an AVX2-only laptop, an AMX Xeon, an ARM Mac) the kernels add floats in another
order, so it allows what that can change and nothing else: every key, string, hash and token count
the same; every probability vector's argmax the same; each raw probability within ``RAW_TOLERANCE``
of the file's; each wire answer (4 decimals) within that bound plus one last-digit step.

The models are ``clef-gguf demo`` builds (random seeded weights, made here): f32 with a fine-tune,
and q8_0. Each request goes through ``decide``, ``decide_many`` (packed and one at a time) and
``probabilities``; the fine-tune answers through ``model`` routing. Media: one generated picture.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from clef_gguf.core.children import module_command

REQUESTS = [
    {"state": "Invoice INV-2291 for $1,250.00 was due on 2026-10-01 and is still unpaid.",
     "questions": {"overdue": {"type": "noul", "instructions": "Is the invoice overdue?"},
                   "action": {"type": "choice", "instructions": "What should happen next?",
                              "criteria": {"remind": "Send a payment reminder.", "escalate": None,
                                           "close": "Close the invoice."}}}},
    {"state": {"ticket": 48213, "text": "The app crashes when I upload a photo.", "plan": "pro"},
     "questions": {"sentiment": {"type": "score", "instructions": "How frustrated is the customer?",
                                 "criteria": ["calm", "annoyed", "angry", "furious"]},
                   "team": {"type": "choice", "criteria": {"mobile": None, "billing": None, "web": None}},
                   "bug": {"type": "noul"}}},
    {"state": "deploy 7f3a: 12 pods restarted, p95 latency 2.4s. " * 20,
     "questions": {"rollback": {"type": "noul"},
                   "severity": {"type": "score", "criteria": ["sev4", "sev3", "sev2", "sev1"]}}},
    {"state": ["résumé reçu", "naïve café", {"lang": "fr", "score": 0.875}],
     "questions": {"language": {"type": "choice", "criteria": {"fr": "French", "en": "English"}},
                   "complete": {"type": "noul", "criteria": {"true": "All fields present", "false": None}}},
     "typo_key": 1},
    {"state": "Invoice INV-2291 for $1,250.00 was due on 2026-10-01 and is still unpaid.",
     "questions": {"urgent": {"type": "noul"}}},
]


def _picture() -> str:
    from PIL import Image

    img = Image.new("RGB", (40, 28))
    img.putdata([((x * 7) % 256, (y * 11) % 256, (x * y) % 256) for y in range(28) for x in range(40)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _demo(out: Path, *flags: str) -> Path:
    subprocess.run(module_command("clef_gguf.cli", "demo", str(out), *flags), check=True, capture_output=True)
    return out


# Thread counts fixed at those the file was written with, and never what `clef-gguf tune` chose here.
THREADS = 2


def kernel_path() -> dict[str, str]:
    """What decides the float order of an answer on this machine: the SIMD features llama.cpp's CPU
    backend was compiled with (llama-cpp-python builds for the CPU it is built on), torch's kernel
    dispatch for the head, and the two versions."""
    import llama_cpp
    import torch

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    features = [part.split("=")[0].strip() for part in info.replace("CPU :", "|").split("|")
                if part.strip().endswith("= 1")]
    return {"machine": platform.machine(), "llama_cpp": llama_cpp.__version__,
            "llama_cpp_features": " ".join(features), "torch": torch.__version__.split("+")[0],
            "torch_capability": torch.backends.cpu.get_cpu_capability()}


def responses(work: Path) -> dict:
    from clef_gguf import Clef

    f32 = _demo(work / "f32", "--finetune")
    q8 = _demo(work / "q8", "--outtype", "q8_0")
    media = {"state": "What is in the picture?", "images": [_picture()],
             "questions": {"cat": {"type": "noul"}, "colour": {"type": "choice",
                                                               "criteria": {"red": None, "blue": None}}}}
    out: dict = {"kernel_path": kernel_path()}
    for label, directory, adapters in (("f32", f32, {"ft": f32 / "finetune"}), ("q8_0", q8, None)):
        with Clef.load(directory, adapters=adapters, threads=THREADS, head_threads=THREADS, tune=False) as clef:
            got = out[label] = {}
            got["decide"] = [clef.decide(r) for r in REQUESTS]
            got["decide_many"] = list(clef.decide_many(REQUESTS + REQUESTS))
            got["decide_many_pack1"] = list(clef.decide_many(REQUESTS, pack=1))
            got["probabilities"] = [[p.tolist() for p in clef.probabilities(r)] for r in REQUESTS]
            got["media"] = clef.decide(media)
            if adapters:
                got["fine_tune"] = [clef.decide({**r, "model": "ft"}) for r in REQUESTS]
                got["fine_tune_many"] = list(clef.decide_many([{**r, "model": "ft"} for r in REQUESTS]
                                                              + REQUESTS))
    return out


# The largest |difference| of a raw probability allowed between two kernel paths, f32 and q8_0 apart
# (q8_0 also rounds each matmul's activations to 8 bits, so a last-bit difference can cross a rounding
# step). Measured against the file (docs/testing.md): 3.0e-7 / 2.6e-4 at most, on llama.cpp built for
# AVX2 only; f32's bound is the project's parity bar (3.3x that), q8_0's 3.8x. Every argmax agrees too.
RAW_TOLERANCE = {"f32": 1e-6, "q8_0": 1e-3}
WIRE_STEP = 1e-4  # wire answers carry 4 decimals


def differences(want: dict, got: dict) -> tuple[list[str], dict[str, float]]:
    """What tells ``got`` apart from ``want`` beyond float order (messages), and the largest raw
    probability difference per model label."""
    problems: list[str] = []
    largest: dict[str, float] = {}

    def near(a: float, b: float, where: str, label: str, raw: bool, spread: float) -> None:
        bar = RAW_TOLERANCE.get(label, 0.0)
        if raw:
            largest[label] = max(largest.get(label, 0.0), abs(a - b))
            if abs(a - b) > bar:
                problems.append(f"{where}: {a!r} != {b!r} (beyond {bar:g})")
        elif abs(a - b) > bar * spread + WIRE_STEP * 1.001:
            problems.append(f"{where}: {a!r} != {b!r}")

    def walk(a, b, where: str, label: str, raw: bool, spread: float = 1.0) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                problems.append(f"{where}: keys {sorted(a)} != {sorted(b)}")
                return
            # a score's expected level sums every level's probability times its index
            levels = len(a.get("legend", ()))
            for key in a:
                walk(a[key], b[key], f"{where}/{key}", label, raw,
                     levels * (levels - 1) / 2 if key == "score" and levels else 1.0)
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                problems.append(f"{where}: {len(a)} items != {len(b)}")
                return
            if raw and a and all(isinstance(x, float) for x in a + b) and a.index(max(a)) != b.index(max(b)):
                problems.append(f"{where}: argmax {a.index(max(a))} != {b.index(max(b))}")
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]", label, raw)
        elif isinstance(a, float) and isinstance(b, float):
            near(a, b, where, label, raw, spread)
        elif type(a) is not type(b) or a != b:
            problems.append(f"{where}: {a!r} != {b!r}")

    for label in sorted((set(want) | set(got)) - {"kernel_path"}):
        if label not in want or label not in got:
            problems.append(f"/{label}: only in one file")
            continue
        for key in sorted(set(want[label]) | set(got[label])):
            if key not in want[label] or key not in got[label]:
                problems.append(f"/{label}/{key}: only in one file")
            else:
                walk(want[label][key], got[label][key], f"/{label}/{key}", label, key == "probabilities")
    return problems, largest


def verdict(want: dict, got: dict) -> tuple[str, list[str]]:
    """The check's first line and its problems: on the kernel path that wrote the file only the same
    bytes pass; elsewhere the differences float order can make."""
    if want == got:
        return "golden: byte-identical", []
    if want.get("kernel_path") == got["kernel_path"]:
        same = "the same kernels must give the same bytes"
        return "golden: DIFFERENT on the kernel path that wrote the file", [same, *differences(want, got)[0]]
    problems, largest = differences(want, got)
    if problems:
        return "golden: DIFFERENT", problems
    spread = ", ".join(f"{label} {value:.1e}" for label, value in sorted(largest.items()))
    return (f"golden: the same up to float order (kernel path {_path_words(got['kernel_path'])}; file written on "
            f"{_path_words(want.get('kernel_path', {}))}; largest raw difference: {spread})"), []


def _path_words(path: dict) -> str:
    return f"llama.cpp {path.get('llama_cpp_features', '?')} / torch {path.get('torch_capability', '?')}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--check", action="store_true", help="compare with FILE instead of writing it")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = responses(Path(tmp))
    text = json.dumps(got, ensure_ascii=False, indent=1, sort_keys=True) + "\n"
    if not args.check:
        Path(args.file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.file).write_text(text, encoding="utf-8")
        return 0
    want = json.loads(Path(args.file).read_text(encoding="utf-8"))
    first, problems = verdict(want, json.loads(text))
    print(first)
    if not problems:
        return 0
    Path(args.file + ".new").write_text(text, encoding="utf-8")
    print(f"(the new answers: {args.file}.new)")
    print("\n".join(problems[:20]))
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""Responses of the demo models to a fixed set of requests, through the public Python API only, so
that a change of structure can be checked to leave every answer byte-identical.

    python scripts/golden.py tests/golden/responses.json           # write (before the change)
    python scripts/golden.py --check tests/golden/responses.json   # compare (after it)

Byte-identical on the machine that wrote the file. Another CPU's kernels add floats in another order,
so ``--check`` then allows what that can change and nothing else: every key, string, hash and token
count the same; each raw probability within ``RAW_TOLERANCE`` of the file's; each wire answer (4
decimals) the same or one last-digit step away, which a rounding boundary between the two makes.

The models are ``clef-gguf demo`` builds (random seeded weights, made here): f32 with a fine-tune,
and q8_0. Each request goes through ``decide``, ``decide_many`` (packed and one at a time) and
``probabilities``; the fine-tune answers through ``model`` routing. Media: one generated picture.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
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


def responses(work: Path) -> dict:
    from clef_gguf import Clef

    f32 = _demo(work / "f32", "--finetune")
    q8 = _demo(work / "q8", "--outtype", "q8_0")
    media = {"state": "What is in the picture?", "images": [_picture()],
             "questions": {"cat": {"type": "noul"}, "colour": {"type": "choice",
                                                               "criteria": {"red": None, "blue": None}}}}
    out: dict = {}
    for label, directory, adapters in (("f32", f32, {"ft": f32 / "finetune"}), ("q8_0", q8, None)):
        with Clef.load(directory, adapters=adapters) as clef:
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


# Largest |difference| of a raw probability between two CPUs. f32: the project's parity bar with
# Cloudflare's reference (measured 2.7e-7 between the machine that wrote the file and an AVX-512/AMX
# Xeon). q8_0: llama.cpp quantizes each matmul's activations to 8 bits, so a last-bit difference can
# cross a quantization step (measured 1.4e-5); the bar is the wire's resolution.
RAW_TOLERANCE = {"f32": 1e-6, "q8_0": 1e-4}
WIRE_STEP = 1e-4  # wire answers carry 4 decimals


def differences(want: dict, got: dict) -> tuple[list[str], dict[str, float]]:
    """What tells ``got`` apart from ``want`` beyond float order (messages), and the largest raw
    probability difference per model label."""
    problems: list[str] = []
    largest: dict[str, float] = {}

    def walk(a, b, where: str, raw: str | None) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                problems.append(f"{where}: keys {sorted(a)} != {sorted(b)}")
                return
            for key in a:
                walk(a[key], b[key], f"{where}/{key}", raw)
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                problems.append(f"{where}: {len(a)} items != {len(b)}")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]", raw)
        elif isinstance(a, float) and isinstance(b, float):
            if raw is not None:
                largest[raw] = max(largest.get(raw, 0.0), abs(a - b))
                bar = RAW_TOLERANCE.get(raw, 0.0)
                if abs(a - b) > bar:
                    problems.append(f"{where}: {a!r} != {b!r} (beyond {bar:g})")
            elif abs(a - b) > WIRE_STEP * 1.001:
                problems.append(f"{where}: {a!r} != {b!r}")
        elif type(a) is not type(b) or a != b:
            problems.append(f"{where}: {a!r} != {b!r}")

    for label in sorted(set(want) | set(got)):
        if label not in want or label not in got:
            problems.append(f"/{label}: only in one file")
            continue
        for key in sorted(set(want[label]) | set(got[label])):
            raw = label if key == "probabilities" else None
            if key not in want[label] or key not in got[label]:
                problems.append(f"/{label}/{key}: only in one file")
            else:
                walk(want[label][key], got[label][key], f"/{label}/{key}", raw)
    return problems, largest


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
    want = Path(args.file).read_text(encoding="utf-8")
    if want == text:
        print("golden: byte-identical")
        return 0
    problems, largest = differences(json.loads(want), got)
    if not problems:
        spread = ", ".join(f"{label} {value:.1e}" for label, value in sorted(largest.items()))
        print(f"golden: the same up to float order (largest raw difference: {spread})")
        return 0
    Path(args.file + ".new").write_text(text, encoding="utf-8")
    print(f"golden: DIFFERENT (see {args.file}.new)")
    print("\n".join(problems[:20]))
    return 1


if __name__ == "__main__":
    sys.exit(main())

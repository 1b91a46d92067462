"""Responses of the demo models to a fixed set of requests, through the public Python API only, so
that a change of structure can be checked to leave every answer byte-identical.

    python scripts/golden.py tests/golden/responses.json           # write (before the change)
    python scripts/golden.py --check tests/golden/responses.json   # compare (after it)

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
    subprocess.run([sys.executable, "-m", "clef_gguf.cli", "demo", str(out), *flags], check=True,
                   capture_output=True)
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
    Path(args.file + ".new").write_text(text, encoding="utf-8")
    print(f"golden: DIFFERENT (see {args.file}.new)")
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""Every answer of the demo models, byte for byte, as before the runtime was split into layers
(``tests/golden/responses.json``, written by ``scripts/golden.py`` on the commit before the move)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "responses.json"


def test_the_demo_models_answer_byte_identically_to_the_golden_file(tmp_path):
    copy = tmp_path / "responses.json"  # the check writes FILE.new beside it on a difference
    shutil.copy(GOLDEN, copy)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "golden.py"), "--check", str(copy)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.strip() == "golden: byte-identical"


def test_the_check_fails_on_a_changed_answer(tmp_path):
    copy = tmp_path / "responses.json"
    copy.write_text(GOLDEN.read_text(encoding="utf-8").replace('"noul": 0.5541', '"noul": 0.5542', 1),
                    encoding="utf-8")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "golden.py"), "--check", str(copy)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 1 and "DIFFERENT" in proc.stdout

"""The wheel users install: everything under clef_gguf/, no generic top-level package names."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("clef_gguf-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"clef_gguf"}  # no top-level `convert`
    for needed in ("clef_gguf/heads/joint.py", "clef_gguf/convert/hf_to_gguf.py",
                   "clef_gguf/models/catalog.json", "clef_gguf/cli.py",
                   "clef_gguf/server/static/index.html", "clef_gguf/server/static/app.js"):
        assert needed in names
    # every source module of every folder lands in the wheel (a sub-package missing from
    # pyproject's list would be left out silently)
    folders = {"clef_gguf": "clef_gguf", "heads": "clef_gguf/heads", "convert": "clef_gguf/convert",
               "models": "clef_gguf/models"}
    for folder, target in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert f"{target}/{path.relative_to(ROOT / folder).as_posix()}" in names, path
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "clef-gguf = clef_gguf.cli:main" in entry_points

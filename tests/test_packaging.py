"""The wheel users install: everything under clef_gguf/, no generic top-level package names; and the
installed package run as the README installs it (``pip install .``, not editable) from a clone's root."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out), str(ROOT)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    (found,) = out.glob("clef_gguf-*.whl")
    return found


def test_wheel_layout(wheel):
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


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A bare venv holding the project's wheel (``--no-deps``), whose other requirements come from this
    test venv's site-packages through a ``.pth`` line: no second torch, no second llama.cpp compile. Paths
    that a ``.pth`` line adds are not site directories, so the editable install's finder is not loaded
    there: ``clef_gguf`` is the wheel's, as after the README's ``pip install .``. Returns its bin/."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    bare = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (bare / "test-venv.pth").write_text("\n".join(ours) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                           "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    where = subprocess.run([python, "-c", "import clef_gguf.heads, clef_gguf; print(clef_gguf.__file__)"],
                           check=True, capture_output=True, text=True, cwd=venv).stdout.strip()
    assert Path(where).is_relative_to(bare)  # the wheel's package, not the clone's or the editable one
    return venv / "bin"


def _from_the_root(bin_dir: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``clef-gguf ARGV`` run from the clone's root, where ``python -m`` would find the clone's
    ``clef_gguf/`` folder first (it has no heads/, convert/ or models/ of its own)."""
    assert (ROOT / "clef_gguf").is_dir() and not (ROOT / "clef_gguf" / "models").exists()
    return subprocess.run([str(bin_dir / "clef-gguf"), *argv], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=900)


def test_pick_reprobe_from_the_clones_root_runs_its_probe_process(installed, tmp_path):
    """The speed probe's process (``python -m clef_gguf.pick.speed_run``) imports the installed package:
    it failed with ``No module named 'clef_gguf.models'`` from here before ``core.children``."""
    proc = _from_the_root(installed, "pick", "--quants", "Q4_K_M", "--reprobe", "--tokens", "64", "--json",
                          env={"HF_HOME": str(tmp_path / "hf")})
    data = json.loads(proc.stdout)
    assert proc.returncode in (0, 1) and "error" not in data, data  # 1: nothing fits this machine's memory
    table = data["speed"]
    row = table["quants"]["Q4_K_M"]
    assert row["error"] is None and row["seconds"] > 0, row


def test_convert_to_a_quant_from_the_clones_root_runs_its_quantizer_process(installed, tiny_release, tmp_path):
    """``convert --outtype Q4_K_M`` quantizes in a child process (``python -m clef_gguf.convert.quantize``)."""
    out = tmp_path / "q4"
    proc = _from_the_root(installed, "convert", str(tiny_release), str(out), "--outtype", "Q4_K_M")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "clef-gguf.json").read_text())
    assert "q4_k_m" in json.dumps(manifest).lower() and list(out.glob("*.gguf"))


def test_ray_batch_from_the_clones_root_imports_the_installed_package_in_its_workers(installed, tiny_model_dir,
                                                                                     tmp_path):
    """Ray puts the driver's working directory first on its workers' sys.path: a local Ray started from
    here would import the clone's ``clef_gguf/`` in every worker (``core.children.start_ray``)."""
    records = tmp_path / "in.jsonl"
    records.write_text("".join(json.dumps({"id": str(i), "state": f"Invoice {i} is overdue.",
                                           "questions": {"overdue": {"type": "noul"}}}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    proc = _from_the_root(installed, "batch", "--model", str(tiny_model_dir), "--input", str(records), "--output",
                          str(out), "--engine", "ray", "--replicas", "1", "--threads-per-replica", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(answers) == 3 and all("error" not in a for a in answers), answers

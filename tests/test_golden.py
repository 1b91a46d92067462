"""Every answer of the demo models as before the runtime was split into layers
(``tests/golden/responses.json``, written by ``scripts/golden.py`` on the commit before the move):
byte-identical on the kernel path that wrote it, the same up to float order on another one."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "responses.json"
_spec = importlib.util.spec_from_file_location("golden_script", ROOT / "scripts" / "golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def _check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "golden.py"), "--check", str(path)],
                          capture_output=True, text=True, cwd=path.parent, timeout=600)


def test_the_demo_models_answer_as_the_golden_file(tmp_path):
    copied = tmp_path / "responses.json"  # the check writes FILE.new beside it on a difference
    shutil.copy(GOLDEN, copied)
    proc = _check(copied)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    first = proc.stdout.strip().splitlines()[0]
    assert first == "golden: byte-identical" or first.startswith("golden: the same up to float order")


def test_the_check_fails_on_a_changed_answer(tmp_path):
    copied = tmp_path / "responses.json"
    copied.write_text(GOLDEN.read_text(encoding="utf-8").replace('"noul": 0.5541', '"noul": 0.5641', 1),
                      encoding="utf-8")
    proc = _check(copied)
    assert proc.returncode == 1 and "DIFFERENT" in proc.stdout
    assert "/f32/decide[0]/answers/overdue/noul: 0.5641 != 0.5541" in proc.stdout


@pytest.fixture(scope="module")
def want() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def _changed(want: dict, edit) -> dict:
    got = copy.deepcopy(want)
    edit(got)
    return got


def test_float_order_differences_pass_and_are_measured(want):
    f32, q8 = 0.9 * golden.RAW_TOLERANCE["f32"], 0.9 * golden.RAW_TOLERANCE["q8_0"]

    def edit(got):
        got["f32"]["probabilities"][0][0][0] += f32
        got["q8_0"]["probabilities"][1][0][1] -= q8
        got["f32"]["decide"][0]["answers"]["overdue"]["noul"] = 0.5542  # a rounding boundary crossed
        got["q8_0"]["decide"][4]["answers"]["urgent"]["noul"] += 3e-4  # an AVX2 build, measured
    problems, largest = golden.differences(want, _changed(want, edit))
    assert problems == []
    assert largest["f32"] == pytest.approx(f32, rel=1e-3)
    assert largest["q8_0"] == pytest.approx(q8, rel=1e-3)


@pytest.mark.parametrize("edit, where", [
    (lambda g: g["f32"]["probabilities"][0][0].__setitem__(
        0, g["f32"]["probabilities"][0][0][0] + 2 * golden.RAW_TOLERANCE["f32"]),
     "/f32/probabilities[0][0][0]"),
    (lambda g: g["q8_0"]["probabilities"][0][0].__setitem__(
        0, g["q8_0"]["probabilities"][0][0][0] + 2 * golden.RAW_TOLERANCE["q8_0"]), "/q8_0/probabilities[0][0][0]"),
    (lambda g: g["f32"]["decide"][0]["answers"]["overdue"].__setitem__("noul", 0.5543),
     "/f32/decide[0]/answers/overdue/noul"),
    (lambda g: g["f32"]["decide"][0]["answers"]["action"].__setitem__("choice", "remind"),
     "/f32/decide[0]/answers/action/choice"),
    (lambda g: g["f32"]["decide"][0]["audit"].__setitem__("input_tokens", [555]),
     "/f32/decide[0]/audit/input_tokens[0]"),
    (lambda g: g["f32"]["decide"][0]["answers"].pop("overdue"), "/f32/decide[0]/answers: keys"),
    (lambda g: g["q8_0"]["decide_many"].pop(), "/q8_0/decide_many: 10 items != 9"),
    (lambda g: g.pop("q8_0"), "/q8_0: only in one file"),
])
def test_anything_float_order_cannot_change_fails(want, edit, where):
    problems, _ = golden.differences(want, _changed(want, edit))
    assert len(problems) == 1 and problems[0].startswith(where), problems


def _elsewhere(want: dict) -> dict:
    """``want`` as a machine with other kernels would answer it: the path differs, nothing else yet."""
    got = copy.deepcopy(want)
    got["kernel_path"] = {**want["kernel_path"], "llama_cpp_features": "SSE3 SSSE3 AVX AVX2 F16C FMA"}
    return got


def test_the_file_records_the_kernel_path_it_was_written_on(want):
    path = want["kernel_path"]
    assert set(path) == {"machine", "llama_cpp", "llama_cpp_features", "torch", "torch_capability"}
    assert "AVX2" in path["llama_cpp_features"].split() and path["torch_capability"]


def test_the_kernel_path_that_wrote_the_file_wants_the_same_bytes(want):
    got = copy.deepcopy(want)
    assert golden.verdict(want, got) == ("golden: byte-identical", [])
    got["f32"]["probabilities"][0][0][0] += 1e-9  # float order only: fine elsewhere, not here
    first, problems = golden.verdict(want, got)
    assert first == "golden: DIFFERENT on the kernel path that wrote the file" and problems


def test_another_kernel_path_gets_the_measured_bounds(want):
    got = _elsewhere(want)
    got["f32"]["probabilities"][0][0][0] += 1e-9
    got["q8_0"]["probabilities"][4][0][0] -= 2.6e-4  # an AVX2-only EPYC against the file, as reported
    first, problems = golden.verdict(want, got)
    assert problems == [] and first.startswith("golden: the same up to float order (kernel path llama.cpp SSE3")
    assert "q8_0 2.6e-04" in first
    got["q8_0"]["probabilities"][4][0][0] -= golden.RAW_TOLERANCE["q8_0"]
    first, problems = golden.verdict(want, got)
    assert first == "golden: DIFFERENT" and problems[0].startswith("/q8_0/probabilities[4][0][0]")


def test_an_argmax_that_changes_fails_whatever_the_bound(want, monkeypatch):
    monkeypatch.setitem(golden.RAW_TOLERANCE, "q8_0", 1.0)  # even with no bound on the values
    got = _changed(want, lambda g: g["q8_0"]["probabilities"][2].__setitem__(1, g["q8_0"]["probabilities"][2][1][::-1]))
    problems, _ = golden.differences(want, got)
    assert problems == ["/q8_0/probabilities[2][1]: argmax 3 != 0"]  # four levels, reversed

"""The GPU check (the package ``scripts/gpu_check``) runs here too. ``gpu-check.sh --dry-run`` runs every
row's code path on the CPU (the report's schema, the priority order); the plan and the deadline are
checked with a fake clock and with rows of a few seconds (a row cut off keeps its measurements and leaves
no process behind); the bundle is made with a prebuilt llama.cpp wheel from a local wheel folder and
installed with no index; ``python scripts/gpu_check nvfp4-backend`` asserts what is true of this machine
(a CUDA device or not: both branches assert, neither is skipped). The package's modules import one way
only (no cycle), and every parity bar it applies is ``clef_gguf.core.limits``'."""

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from clef_gguf.core import limits

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "scripts" / "gpu_check"


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    """``python scripts/gpu_check ARGV``: the package by path, as gpu-check.sh runs it."""
    return subprocess.run([sys.executable, str(PACKAGE), *argv], capture_output=True, text=True, timeout=timeout)


def cuda_device() -> bool:
    """Whether torch sees a CUDA device, as ``gpu_check.nvfp4_backend`` asks."""
    import torch

    return torch.cuda.is_available()


def assert_nvfp4_check(stdout: str, returncode: int, cuda: bool, stderr: str) -> None:
    report = json.loads(stdout)
    if cuda:  # the success report: kernels, the FP4 GEMM probe, agreement, latencies, exit 0
        assert "error" not in report, (report, stderr)
        assert isinstance(report["gpu"], str) and report["gpu"], report
        capability = report["capability"]
        assert len(capability) == 2 and all(isinstance(c, int) for c in capability), report
        assert isinstance(report["native_fp4"], bool), report
        probe = report["scaled_mm_fp4"]
        assert probe == "ran" or probe.startswith("refused: "), report
        kernel = report["kernel"]  # keyed by the W4A4 flag, False and True, as JSON writes them
        assert set(kernel) == {"false", "true"}, report
        assert all(isinstance(k, str) and k for k in kernel.values()), report
        worst = report["tiny_fp32_gpu_vs_cpu_max_abs_dp"]
        assert worst["nvfp4a16"] <= limits.NVFP4_FP32_MAX_DP and worst["nvfp4"] <= limits.NVFP4_W4A4_FP32_MAX_DP, report
        assert set(report["latency_ms"]) == {"tiny", "qwen08b"}, report
        for preset, schemes in report["latency_ms"].items():
            assert set(schemes) == {"nvfp4a16", "nvfp4"}, (preset, schemes)
            for scheme, t in schemes.items():
                assert 0 < t["min"] <= t["median"] <= t["max"], (preset, scheme, t)
        assert returncode == 0, (report, stderr)
    else:
        assert report == {"error": "no CUDA device"}
        assert returncode == 1


def test_nvfp4_gpu_check_reports_what_this_machine_has():
    cuda = cuda_device()
    print(f"\ngpu_check nvfp4-backend {'with a CUDA device' if cuda else 'without CUDA'}")
    # on a GPU it builds, quantizes and times a 0.8B-shaped release as well: a longer bound
    proc = _run("nvfp4-backend", timeout=900 if cuda else 300)
    assert_nvfp4_check(proc.stdout, proc.returncode, cuda, proc.stderr)


ROWS = ["preflight", "parity", "latency", "throughput", "pick", "nvfp4", "kernels"]


def _package() -> None:
    """``scripts/gpu_check`` imported as ``gpu_check``, the name its modules import each other by
    (``scripts/`` itself stays off ``sys.path``)."""
    spec = importlib.util.spec_from_file_location("gpu_check", PACKAGE / "__init__.py",
                                                  submodule_search_locations=[str(PACKAGE)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)


_package()
gpu_run = importlib.import_module("gpu_check.run")  # the plan and the deadline
gpu_rows = importlib.import_module("gpu_check.rows")  # the rows in priority order
gpu_common = importlib.import_module("gpu_check.common")  # the common rows


def _check(*argv: str, tmp_path: Path, timeout: float = 1200, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), *argv, "--report", str(report)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
    return proc, json.loads(report.read_text())


@pytest.mark.slow
def test_the_dry_run_runs_every_row_on_the_cpu_into_one_report(tmp_path):
    proc, report = _check("--dry-run", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert report["schema"] == "clef-gguf-gpu-check/2" and report["dry_run"] and report["finished"]
    assert [r["name"] for r in report["rows"]] == ROWS and [r["priority"] for r in report["rows"]] == list(range(1, 8))
    assert report["offline_env"]["HF_HUB_OFFLINE"] == "1" and set(report["planned_s"]) == set(ROWS)
    rows = {r["name"]: r for r in report["rows"]}
    assert {r["status"] for r in rows.values()} <= {"passed", "measured"}, rows
    assert rows["preflight"]["offline"]["HF_HUB_OFFLINE"] == "1"
    parity = rows["parity"]
    assert parity["max_abs_dp"] == 0.0 and parity["head_on_cpu"]["argmax_agrees"] and parity["within_goal"]
    assert parity["packed_vs_one"]["max_abs_dp"] == 0.0  # the CPU's packing is byte-identical
    first = rows["latency"]["by_tokens"]["64"]
    assert first["head_ms"]["median"] > 0 and first["tower_ms"]["min"] <= first["tower_ms"]["median"]
    assert rows["latency"]["measured"]["model_write_s"] >= 0  # measurements stream in as they are taken
    assert set(rows["throughput"]["decide_many_per_s"]) == {"1", "4", "16"}
    served = rows["throughput"]["serve"]
    assert [lv["concurrency"] for lv in served["levels"]] == [1, 4] and served["input_tokens"] >= 100
    assert all(lv["failed"] == 0 for lv in served["levels"]) and rows["throughput"]["tolerance"] == 0.0
    assert rows["pick"]["ratio"] > 0
    nv = rows["nvfp4"]
    assert nv["pytorch_fp32_gpu_vs_cpu_max_abs_dp"] == 0.0 and set(nv["total_ms"]) == {
        "nvfp4-gguf", "Q4_K_M", "pytorch-nvfp4a16"}
    assert set(nv["max_abs_dp_vs_pytorch"]) == {"nvfp4-gguf", "Q4_K_M"}
    assert all(0 <= v < 1 for v in nv["max_abs_dp_vs_pytorch"].values())
    assert set(nv["pytorch_decisions_per_s"]) == {"pack_1", "packed"}
    bf16 = nv["pytorch_bf16_vs_reference_bf16"]
    assert 0 <= bf16["max_abs_dp"] <= limits.NVFP4_BF16_MAX_DP and 0 <= bf16["hidden_max_rel"] < 2e-2, bf16
    tune = rows["kernels"]["tune"]  # clef-gguf tune's JSON, as it printed it
    assert tune["device"] == "cpu" and tune["trials"] and isinstance(tune["chosen"], dict)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_plan_skips_a_row_whose_cost_does_not_fit_the_time_left(tmp_path):
    """A fake clock and rows that take what they are told: throughput runs long, so nvfp4's 150 s no
    longer fit in the 480 s and it is skipped before it starts; kernels runs after, on its own budget."""
    clock = _Clock()
    took = {"preflight": 15, "parity": 30, "latency": 75, "throughput": 250, "pick": 60, "kernels": 100}
    budgets = {}

    def runner(name, work, dry, left, entry, save, rows_from, clk):
        budgets[name] = left
        clock.now += took[name]
        return {"status": "measured"}

    report = tmp_path / "r.json"
    assert gpu_run.main(["--report", str(report)], clock=clock, runner=runner) == 0
    data = json.loads(report.read_text())
    status = {r["name"]: r["status"] for r in data["rows"]}
    assert status == {**{n: "measured" for n in ROWS}, "nvfp4": "skipped"}
    nvfp4 = next(r for r in data["rows"] if r["name"] == "nvfp4")
    assert "50 s left" in nvfp4["reason"] and "plans 150 s" in nvfp4["reason"]
    assert budgets["preflight"] == 480 and budgets["pick"] == 110 and budgets["kernels"] == 180
    assert data["finished"] and data["failed"] == [] and data["seconds"] == sum(took.values())
    assert gpu_run.plan_row(gpu_rows.ROWS[0], 0.5, dry=True).run is False
    assert gpu_run.plan_row(gpu_rows.ROWS[-1], 2.0, dry=True).run is True  # no costs in a dry run


SLOW_ROWS = '''
import os, subprocess, sys, time
from gpu_check.report import record
from gpu_check.rows import Row

def quick(work, dry):
    return {"status": "passed", "value": record("value", 1)}

def stuck(work, dry):
    record("first", 1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(os.environ["GRANDCHILD_PID"], "w").write(str(child.pid))
    record("second", 2)
    time.sleep(300)
    return {"status": "measured"}

ROWS = (Row("quick", quick, 1), Row("stuck", stuck, 1))
'''
BURST_ROWS = '''
import json, sys, time
from gpu_check.rows import Row

def burst(work, dry):
    a, b = ({"measure": key, "value": value} for key, value in (("a", 1), ("b", 2)))
    sys.stdout.write(json.dumps(a) + "\\n" + json.dumps(b) + "\\n")
    sys.stdout.flush()  # two lines in one write: one read of the pipe takes both
    time.sleep(300)
    return {"status": "measured"}

ROWS = (Row("burst", burst, 1),)
'''


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # ended, waiting for its parent to read its status


def test_a_row_cut_off_keeps_what_it_measured_and_leaves_no_process(tmp_path):
    rows = tmp_path / "rows.py"
    rows.write_text(SLOW_ROWS)
    report = tmp_path / "r.json"
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, str(PACKAGE), "--dry-run", "--deadline", "40",
                             "--rows-from", str(rows), "--report", str(report)],
                            env={**os.environ, "CLEF_GPU_WORK": str(work), "GRANDCHILD_PID": str(tmp_path / "pid")},
                            stderr=subprocess.PIPE, text=True)
    seen_running = None
    until = time.monotonic() + 40
    while time.monotonic() < until:  # the measurements are in the report while the row still runs
        time.sleep(0.1)
        data = json.loads(report.read_text()) if report.is_file() else {"rows": []}
        stuck = next((r for r in data["rows"] if r["name"] == "stuck"), {})
        if stuck.get("status") == "running" and stuck.get("measured", {}).get("second") == 2:
            seen_running = stuck
            break
    assert seen_running is not None, data
    assert proc.wait(60) == 0, proc.stderr.read()
    data = json.loads(report.read_text())
    quick, stuck = data["rows"]
    assert quick["status"] == "passed" and quick["measured"] == {"value": 1}
    assert stuck["status"] == "cut" and stuck["measured"] == {"first": 1, "second": 2}, stuck
    assert "deadline" in stuck["reason"] and data["failed"] == [] and data["finished"]
    assert _gone(int((tmp_path / "pid").read_text())), "the row's own child outlived the deadline"
    assert list(work.iterdir()) == []  # the run's folder went with it


def test_with_a_fake_clock_the_deadline_cuts_a_row_after_its_second_measurement(tmp_path, monkeypatch):
    """The clock jumps past the deadline the moment the row's second measurement is in: the row is cut,
    keeps both, and its process group (the row and the child it started) is gone."""
    rows = tmp_path / "rows.py"
    rows.write_text(SLOW_ROWS)
    monkeypatch.setenv("GRANDCHILD_PID", str(tmp_path / "pid"))
    entry: dict = {}
    saved = []
    clock = lambda: 1e9 if "second" in entry.get("measured", {}) else 0.0  # noqa: E731
    result = gpu_run.run_row("stuck", tmp_path, True, 600, entry, lambda: saved.append(dict(entry["measured"])),
                               str(rows), clock)
    assert result["status"] == "cut" and entry["measured"] == {"first": 1, "second": 2}
    assert saved == [{"first": 1}, {"first": 1, "second": 2}]  # the report was written at each one
    assert _gone(int((tmp_path / "pid").read_text()))


def test_lines_that_arrive_together_are_all_kept_before_the_deadline(tmp_path):
    """Two measurements in one write of the pipe: both reach the report although the row then hangs
    until the deadline cuts it (a select() on the buffered stream saw only the first)."""
    rows = tmp_path / "rows.py"
    rows.write_text(BURST_ROWS)
    entry: dict = {}
    result = gpu_run.run_row("burst", tmp_path, True, 8, entry, lambda: None, str(rows))
    assert result["status"] == "cut" and entry["measured"] == {"a": 1, "b": 2}, (result, entry)


def test_preflight_names_every_missing_or_unfit_dependency(tmp_path, monkeypatch):
    """The bundle installs --no-deps: preflight walks clef-gguf's requirements (and their own) and names
    what is not installed or not at a version asked for."""
    assert gpu_common.missing_distributions() == []  # this environment has the whole closure
    info = tmp_path / "fake_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-dist\nVersion: 1.0\n"
                                   "Requires-Dist: no-such-dist-xyz>=1\nRequires-Dist: pytest<1\n"
                                   "Requires-Dist: another-missing; extra == 'unused'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = gpu_common.missing_distributions("fake-dist", (), ())
    assert missing[0].startswith("no-such-dist-xyz (not installed; fake-dist needs it)")
    assert missing[1].startswith("pytest ") and "(not <1; fake-dist needs it)" in missing[1] and len(missing) == 2
    assert gpu_common.missing_distributions("clef-gguf", (), ("absent-dist-xyz",)) == [
        "absent-dist-xyz (not installed)"]


def test_a_row_that_fails_is_reported_so_and_fails_the_check(tmp_path):
    entry: dict = {}
    crashed = gpu_run.run_row("no-such-row", tmp_path, True, 120, entry, lambda: None)  # the child raises
    assert crashed["status"] == "failed" and "KeyError" in crashed["reason"]

    def runner(name, work, dry, left, entry, save, rows_from, clock):
        return {"status": "failed", "reason": "GPU and CPU disagree"} if name == "parity" else {"status": "passed"}

    report = tmp_path / "r.json"
    assert gpu_run.main(["--dry-run", "--rows", "pick,preflight,parity", "--report", str(report)], runner=runner) == 1
    data = json.loads(report.read_text())
    assert data["failed"] == ["parity"]
    assert [(r["name"], r["status"]) for r in data["rows"]] == [  # priority order, whatever --rows said
        ("preflight", "passed"), ("parity", "failed"), ("pick", "passed")]


def test_an_unknown_row_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_run.main(["--dry-run", "--rows", "latency,warp", "--report", str(tmp_path / "r.json")])
    assert exc.value.code == 2 and "warp" in capsys.readouterr().err


def test_a_relative_report_path_is_the_callers_folders(tmp_path):
    """gpu-check.sh runs the check from a scratch folder: a relative --report still lands where it was asked."""
    for argv in (["--report", "here.json"], ["--report=there.json"]):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--rows", "preflight",
                               *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    for name in ("here.json", "there.json"):
        assert json.loads((tmp_path / name).read_text())["rows"][0]["name"] == "preflight"


def _script_modules() -> dict[str, Path]:
    """Every module of ``scripts/`` by the name it is imported by: a script by its stem, the GPU check's
    modules as ``gpu_check.NAME`` (its ``__init__`` as ``gpu_check``)."""
    found = {path.stem: path for path in (ROOT / "scripts").glob("*.py")}
    for path in PACKAGE.glob("*.py"):
        found["gpu_check" if path.stem == "__init__" else f"gpu_check.{path.stem}"] = path
    return found


def _imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere in its file (inside functions too, a
    package's ``__init__`` with each of its modules; ``from pkg import mod`` -> ``pkg.mod``)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package ``level - 1`` folders up
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            out |= {m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in known}
    return out - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the path that closes it, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_module_of_scripts_imports_one_that_imports_it_back():
    """The GPU check is one package whose modules import one way only (``report`` <- ``common`` <- ``nvfp4``
    <- ``rows`` <- ``run``; the commands on top), and no script of ``scripts/`` is part of a cycle."""
    modules = _script_modules()
    graph = {name: _imports_of(name, path, set(modules)) for name, path in modules.items()}
    assert _cycle(graph) is None, f"an import cycle in scripts/: {' -> '.join(_cycle(graph))}"
    assert {"gpu_check.report", "gpu_check.common"} <= graph["gpu_check.nvfp4"]  # the checks see imports
    assert graph["gpu_check.rows"] >= {"gpu_check.common", "gpu_check.nvfp4"} and not graph["gpu_check.report"]
    scripts = [m for m in modules if "." not in m]
    beside = [m for m in scripts if m.startswith("gpu_") and m not in {"gpu_check", "gpu_bundle_wheels"}]
    assert not beside, f"GPU check modules beside the package, not in it: {beside}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check finds one


BAR_NAME = re.compile(r"BAR|PARITY|GOAL|TARGET|MAX_DP|TOLERANCE")


def test_every_parity_bar_of_the_gpu_check_comes_from_core_limits():
    """No |dp| bar is written in the package: no float literal of a bar's size (up to 1e-2), no module
    constant named like a bar that holds a number of its own; what it imports from ``core.limits`` is there."""
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        small = [(node.lineno, node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, float) and 0 < node.value <= 1e-2]
        assert not small, f"{path.name}: parity bars written as literals (lines, values) {small}: core.limits'"
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            names = [t.id for t in targets if isinstance(t, ast.Name) and BAR_NAME.search(t.id)]
            numbers = [c.value for c in ast.walk(value) if isinstance(c, ast.Constant)
                       and isinstance(c.value, (int, float)) and not isinstance(c.value, bool)]
            assert not (names and numbers), (
                f"{path.name}:{node.lineno}: {names} holds its own numbers {numbers}: a bar belongs in core.limits")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "clef_gguf.core.limits":
                assert all(hasattr(limits, alias.name) for alias in node.names), (path.name, node.lineno)


def _wheel(folder: Path, name: str, version: str, files: dict[str, str] | None = None,
           tag: str = "py3-none-any") -> Path:
    """A minimal wheel of ``name`` holding ``files`` (a stand-in for one from PyPI)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    info = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    entries = {**(files or {}), **info}
    record = "".join(f"{n},,\n" for n in entries) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in entries.items():
            z.writestr(n, text)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def _bundle_wheels():
    spec = importlib.util.spec_from_file_location("gpu_bundle_wheels", ROOT / "scripts" / "gpu_bundle_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins() -> list[tuple[str, str]]:
    return [tuple(w.split("==")) for w in _bundle_wheels().wheels()] + [("nvidia-cublas", "13.0.0.19")]


def test_the_bundle_lists_every_dependency_and_what_they_need():
    """Every [project].dependencies entry and the nvfp4 extra, with their own needs (pydantic's core, the
    hub's client), pinned as requirements/test.txt pins them; never torch or numpy (the image's)."""
    bw = _bundle_wheels()
    names = {n for n, _ in _pins()}
    assert set(bw.roots()) - names == {"torch", "numpy", "llama-cpp-python"}
    assert {"tokenizers", "safetensors", "huggingface-hub", "pydantic", "pydantic-core", "annotated-types", "psutil",
            "tqdm", "pillow", "av", "transformers", "compressed-tensors", "fastapi", "diskcache", "httpx"} <= names
    assert not names & {"torch", "numpy", "sympy", "triton", "pytest"}
    text = (ROOT / "requirements" / "test.txt").read_text()
    assert all(f"\n{n}=={v}\n" in text for n, v in _pins() if n not in {"fla-core", "einops", "nvidia-cublas"})


def test_a_dependency_with_no_pin_stops_the_bundle_naming_it(tmp_path):
    (tmp_path / "scripts").mkdir()
    for name in ("gpu-bundle.sh", "gpu_bundle_wheels.py"):
        (tmp_path / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "requirements").mkdir()
    pinned = (ROOT / "requirements" / "test.txt").read_text().splitlines()
    (tmp_path / "requirements" / "test.txt").write_text("\n".join(x for x in pinned if not x.startswith("psutil==")))
    llama = _wheel(tmp_path, "llama-cpp-python", "0.3.36", tag="py3-none-linux_x86_64")
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu-bundle.sh"), str(tmp_path / "b"), "--llama-wheel",
                           str(llama)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 1 and "psutil is not pinned in requirements/test.txt" in proc.stderr, proc.stderr
    assert not list((tmp_path / "b").glob("whl/*"))


def test_the_bundle_is_built_from_a_prebuilt_llama_wheel_and_installs_with_no_index(tmp_path):
    """gpu-bundle.sh with --llama-wheel (a stand-in for the CUDA build) and --find-links (a local wheel
    folder for PyPI), then gpu-check.sh's install step with no index: the project and the llama wheel
    import from the site folder."""
    links = tmp_path / "links"
    links.mkdir()
    for name, version in _pins():
        _wheel(links, name, version)
    llama = _wheel(tmp_path, "llama-cpp-python", "0.3.36", {"llama_stub/__init__.py": "BUILT_FOR = 'sm_90'\n"},
                   tag="py3-none-linux_x86_64")
    bundle = tmp_path / "bundle"
    offline = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/none", "PIP_RETRIES": "0", "PYTHON": sys.executable}
    made = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-bundle.sh"), str(bundle), "--llama-wheel", str(llama),
                           "--find-links", str(links)], capture_output=True, text=True, timeout=600, env=offline)
    assert made.returncode == 0, made.stderr
    build = json.loads((bundle / "BUILD.json").read_text())
    assert build["llama_cpp"] == f"prebuilt: {llama.name}" and build["python"] == "3.12"
    assert llama.name in build["wheels"] and any(w.startswith("clef_gguf-") for w in build["wheels"])
    assert any(w.startswith("diskcache-") for w in build["wheels"]) and len(build["wheels"]) == len(_pins()) + 2
    site = tmp_path / "site"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--install-only", str(bundle)],
                          capture_output=True, text=True, timeout=300, env={**offline, "CLEF_GPU_SITE": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(site)
    assert (site / "clef_gguf" / "heads" / "joint.py").is_file() and (site / "llama_stub" / "__init__.py").is_file()
    found = subprocess.run([sys.executable, "-c", "import clef_gguf.pick.speed, llama_stub; print(clef_gguf.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert found.stdout.strip().startswith(str(site)), found.stderr


@pytest.mark.parametrize("argv, said", [(["--cuda-arch", "sm90"], "not a CUDA architecture"),
                                         (["--python-version", "3"], "is not X.Y"),
                                         (["--llama-wheel", "/nonexistent.whl"], "no file"),
                                         (["--frobnicate"], "unknown option --frobnicate"),
                                         (["--cmake-args", "GGML_CUDA_FORCE_CUBLAS=ON"], "not a -DNAME=VALUE flag"),
                                         (["--llama-wheel", str(ROOT / "pyproject.toml"), "--cmake-args",
                                           "-DGGML_CUDA_FORCE_CUBLAS=ON"], "not to a prebuilt --llama-wheel")])
def test_the_bundle_refuses_nonsense_before_building(tmp_path, argv, said):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-bundle.sh"), str(tmp_path / "b"), *argv],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not list((tmp_path / "b").glob("whl/*"))

"""End to end against the transformers reference of the same tiny release (issue 2's gates)."""

import numpy as np
import pytest

from clef_gguf import Clef
from clef_gguf.tools.parity import SAMPLE_REQUESTS, Reference, compare, run_parity


@pytest.fixture(scope="module")
def reference(tiny_release):
    return Reference(tiny_release)


@pytest.mark.parametrize("outtype, max_dp", [("f32", 2e-3), ("f16", 2e-2), ("q8_0", 5e-2)])
def test_gguf_pipeline_matches_transformers(tiny_model_dir_factory, reference, outtype, max_dp,
                                            record_property):
    with Clef.load(tiny_model_dir_factory(outtype), max_length=4096) as clef:
        report = run_parity(clef, reference, SAMPLE_REQUESTS)
    record_property(f"parity_{outtype}", report.to_dict())
    print(f"\nparity {outtype}: max|dp|={report.max_abs_dp:.2e} mean|dp|={report.mean_abs_dp:.2e} "
          f"argmax {report.argmax_agree}/{report.argmax_checked}")
    assert report.questions == 9 and report.options == 27
    assert report.max_abs_dp <= max_dp
    if outtype == "f32":  # the bar: same argmax wherever the reference margin > 0.01
        assert report.argmax_agree == report.argmax_checked > 0


def test_compare_flags_disagreement_and_near_ties():
    ref = [[np.array([0.7, 0.3]), np.array([0.5, 0.495, 0.005])]]
    ours = [[np.array([0.4, 0.6], dtype=np.float32), np.array([0.49, 0.5, 0.01], dtype=np.float32)]]
    report = compare(ours, ref, model="m")
    assert report.argmax_checked == 1 and report.argmax_agree == 0
    assert len(report.near_ties) == 1 and report.near_ties[0]["same_argmax"] is False
    assert abs(report.max_abs_dp - 0.3) < 1e-6


def test_parity_command(tiny_model_dir, tiny_release, tmp_path):
    import json
    import subprocess

    req = tmp_path / "requests.json"
    req.write_text(json.dumps(SAMPLE_REQUESTS[:2]))
    proc = subprocess.run(["clef-gguf", "parity", "--model", str(tiny_model_dir), "--release",
                           str(tiny_release), "--requests", str(req)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["questions"] == 5 and report["max_abs_dp"] <= 2e-3

    bad = subprocess.run(["clef-gguf", "parity", "--model", str(tiny_model_dir), "--release",
                          str(tmp_path / "absent")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["error"]["code"] == "model_not_found"

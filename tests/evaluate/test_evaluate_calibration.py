"""CAL.json: version = digest of the content, lookup by type and band, binding, refusals; and the
runtime applying it (``Clef.load(calibration=)``), byte-identical without one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clef_gguf.pipeline import answer
from clef_gguf.core import errors
from clef_gguf.formats import calibration as cal

BOUND = {"tower_sha256": "t" * 64, "head_sha256": "h" * 64, "head_config_sha256": "c" * 64,
         "prompt_template_sha256": "p" * 64, "adapter_sha256": None}
TABLE = {"choice": {"temperature": 1.5, "source": "type", "n": 40},
         "choice.3_5": {"temperature": 2.0, "source": "band", "n": 35},
         "noul.2": {"temperature": 0.8, "source": "band", "n": 50}}


def test_bands_and_lookup():
    assert [cal.band(n) for n in (1, 2, 3, 5, 6, 10, 11, 255)] == ["2", "2", "3_5", "3_5", "6_10",
                                                                   "6_10", "11", "11"]
    c = cal.Calibration.build({"bound_to": BOUND, "temperatures": TABLE})
    assert c.temperature("choice", 4) == 2.0  # its band
    assert c.temperature("choice", 12) == 1.5  # no band entry: the type's
    assert c.temperature("score", 5) == 1.0  # neither: 1.0
    assert c.temperature("noul", 2) == 0.8
    assert c.temperatures_for((0, 1, 2), (2, 4, 5)) == (0.8, 2.0, 1.0)  # noul, choice, score


def test_version_is_the_content_and_tampering_is_refused(tmp_path):
    c = cal.Calibration.build({"bound_to": BOUND, "temperatures": TABLE})
    assert c.version.startswith("cal-") and len(c.version) == 20
    path = c.write(tmp_path / "cal.json")
    assert cal.Calibration.load(path).version == c.version
    assert cal.Calibration.build({"bound_to": BOUND, "temperatures": TABLE}).version == c.version
    with pytest.raises(errors.InvalidValue, match="never overwritten"):
        c.write(path)
    body = json.loads(path.read_text())
    body["temperatures"]["choice.3_5"]["temperature"] = 3.0
    (tmp_path / "edited.json").write_text(json.dumps(body))
    with pytest.raises(errors.CorruptCalibration, match="does not match its version"):
        cal.Calibration.load(tmp_path / "edited.json")
    for bad in ("not json", "[]", json.dumps({"format": "other"})):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(errors.CorruptCalibration):
            cal.Calibration.load(tmp_path / "bad.json")
    with pytest.raises(errors.CorruptCalibration):
        cal.Calibration.load(tmp_path / "missing.json")
    with pytest.raises(errors.CorruptCalibration, match="temperature in"):
        cal.Calibration.build({"bound_to": BOUND, "temperatures": {"choice": {"temperature": 0}}})
    with pytest.raises(errors.CorruptCalibration, match="bound_to"):
        cal.Calibration.build({"bound_to": {}, "temperatures": TABLE})


def test_binding_mismatch_names_what_differs():
    c = cal.Calibration.build({"bound_to": BOUND, "temperatures": TABLE})
    c.check_bound(dict(BOUND))
    with pytest.raises(errors.CalibrationMismatch, match="tower_sha256"):
        c.check_bound(BOUND | {"tower_sha256": "x" * 64})
    assert cal.load(None) is cal.IDENTITY and cal.load("none") is cal.IDENTITY and cal.load(c) is c
    assert cal.IDENTITY.is_identity and not c.is_identity
    assert cal.IDENTITY.temperatures_for((0, 1), (2, 3)) == (1.0, 1.0)


def test_split_probabilities_without_temperatures_is_unchanged():
    logits = np.array([0.3, -1.2, 2.5, 0.1, 0.0], dtype=np.float32)
    plain = answer.split_probabilities(logits, (2, 3))
    ones = answer.split_probabilities(logits, (2, 3), (1.0, 1.0))
    assert all(np.array_equal(a, b) for a, b in zip(plain, ones))
    hot = answer.split_probabilities(logits, (2, 3), (1.0, 2.0))
    assert np.array_equal(hot[0], plain[0])
    assert np.array_equal(hot[1], answer.softmax32(logits[2:] / np.float32(2.0)))


@pytest.fixture(scope="module")
def tiny_calibration(tiny_model_dir, tmp_path_factory):
    from clef_gguf.runtime.model import Clef

    with Clef.load(tiny_model_dir, threads=1) as clef:
        bound = cal.binding(clef.files, clef.provenance.model_hash, clef.provenance.template_sha256)
    c = cal.Calibration.build({"bound_to": bound, "temperatures": {
        "noul": {"temperature": 2.0, "source": "type", "n": 30},
        "choice": {"temperature": 0.5, "source": "type", "n": 30}}})
    return c.write(tmp_path_factory.mktemp("cal") / "cal.json"), c


REQUEST = {"state": {"ticket": "refund please"}, "questions": {
    "urgent": {"type": "noul"}, "route": {"type": "choice", "criteria": {"a": "x", "b": "y", "c": "z"}},
    "severity": {"type": "score", "criteria": ["low", "mid", "high"]}}}


def test_runtime_applies_the_calibration_and_names_it(tiny_model_dir, tiny_calibration):
    from clef_gguf.runtime.model import Clef

    path, c = tiny_calibration
    with Clef.load(tiny_model_dir, threads=1) as plain:
        raw = plain.decide(REQUEST)
        logits = plain.logits(plain.prepare(REQUEST).encoded)
    assert raw["audit"]["calibration_version"] == "none"
    with Clef.load(tiny_model_dir, threads=1, calibration=path) as calibrated:
        got = calibrated.decide(REQUEST)
        probs = calibrated.probabilities(REQUEST)
    assert got["audit"]["calibration_version"] == c.version
    expected = answer.split_probabilities(logits, (2, 3, 3), (2.0, 0.5, 1.0))
    assert all(np.array_equal(a, b) for a, b in zip(probs, expected))
    assert got["answers"]["urgent"]["noul"] == round(float(expected[0][0]), 4)
    assert got["answers"]["severity"] == raw["answers"]["severity"]  # no score temperature: T = 1
    with Clef.load(tiny_model_dir, threads=1, calibration="none") as none:
        assert json.dumps(none.decide(REQUEST)) == json.dumps(raw)  # byte-identical


def test_a_calibration_for_other_weights_is_refused_at_load(tiny_model_dir_factory, tiny_calibration):
    from clef_gguf.runtime.model import Clef

    path, _ = tiny_calibration
    with pytest.raises(errors.CalibrationMismatch, match="tower_sha256"):
        Clef.load(tiny_model_dir_factory("q8_0"), threads=1, calibration=path)


def test_a_request_must_name_the_loaded_calibration_or_none_at_all(tiny_model_dir, tiny_calibration):
    from clef_gguf.runtime.model import Clef

    path, c = tiny_calibration
    with Clef.load(tiny_model_dir, threads=1, calibration=path) as calibrated:
        plain = calibrated.decide(REQUEST)
        same = calibrated.decide(REQUEST | {"calibration": c.version})
        for got in (same, calibrated.decide(REQUEST | {"calibration": None})):
            assert (got["answers"], got["audit"]) == (plain["answers"], plain["audit"])
            assert "warnings" not in got
        for other, named in (("none", 'no calibration ("none")'), ("cal-0123456789abcdef", "cal-0123"),
                             (7, "calibration 7")):
            for strict in (False, True):
                with pytest.raises(errors.WrongCalibration) as raised:
                    calibrated.decide(REQUEST | {"calibration": other}, strict=strict)
                assert raised.value.field == "calibration" and raised.value.status == 422
                assert raised.value.code == "wrong_calibration"
                assert named in raised.value.message and c.version in raised.value.message
        # decide_many: the refused request fails alone, in its place
        out = list(calibrated.decide_many([REQUEST, REQUEST | {"calibration": "none"},
                                           REQUEST | {"calibration": c.version}]))
        assert out[1]["error"]["code"] == "wrong_calibration"
        assert out[0]["answers"] == out[2]["answers"] == plain["answers"]


def test_without_a_calibration_the_request_key_is_still_ignored(tiny_model_dir, tiny_calibration):
    from clef_gguf.runtime.model import Clef

    _, c = tiny_calibration
    with Clef.load(tiny_model_dir, threads=1) as plain:
        got = plain.decide(REQUEST | {"calibration": c.version})
        assert got["warnings"][0]["code"] == "ignored_field"
        assert got["audit"]["calibration_version"] == "none"
        assert "warnings" not in plain.decide(REQUEST | {"calibration": "none"})
        with pytest.raises(errors.Unsupported):
            plain.decide(REQUEST | {"calibration": c.version}, strict=True)


def test_cli_refuses_a_request_for_another_calibration(tiny_model_dir, tiny_calibration, tmp_path,
                                                       capsys):
    from clef_gguf.cli import main

    path, c = tiny_calibration
    base = ["decide", "-m", str(tiny_model_dir), "--threads", "1", "--calibration", str(path)]
    for asked, code in (("none", 2), ("cal-ffffffffffffffff", 2), (c.version, 0)):
        request = tmp_path / "request.json"
        request.write_text(json.dumps(REQUEST | {"calibration": asked}))
        assert main(base + ["-r", str(request)]) == code
        out = json.loads(capsys.readouterr().out)
        if code:
            assert out["error"]["code"] == "wrong_calibration"
            assert out["error"]["field"] == "calibration"
        else:
            assert out["audit"]["calibration_version"] == c.version and "warnings" not in out

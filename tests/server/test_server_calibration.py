"""A served model with a calibration: requests naming another calibration are refused (422,
field ``calibration``), alone in a batch; the loaded version or no key is answered calibrated."""

import httpx
import pytest

from clef_gguf import Clef
from clef_gguf.formats import calibration as cal
from server_helpers import DEADLINE_S, ThreadServer, request_body, same


@pytest.fixture(scope="module")
def calibrated(tiny_model_dir, tmp_path_factory):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as plain:
        bound = cal.binding(plain.files, plain.provenance.model_hash, plain.provenance.template_sha256)
    c = cal.Calibration.build({"bound_to": bound, "temperatures": {
        "choice": {"temperature": 2.0, "source": "type", "n": 30}}})
    path = c.write(tmp_path_factory.mktemp("cal") / "cal.json")
    with Clef.load(tiny_model_dir, max_length=2048, threads=2, calibration=path) as model:
        yield model


@pytest.fixture(scope="module")
def http(calibrated):
    with ThreadServer(calibrated, max_batch=8) as srv, \
            httpx.Client(base_url=srv.url, timeout=DEADLINE_S) as client:
        yield client


def test_single_requests(http, calibrated):
    version = calibrated.calibration.version
    want = same(calibrated.decide(request_body(1)))
    for body in (request_body(1), request_body(1, calibration=version)):
        out = http.post("/v1/systemone", json=body)
        assert out.status_code == 200 and same(out.json()) == want
        assert out.json()["audit"]["calibration_version"] == version and "warnings" not in out.json()
    for other in ("none", "cal-0000000000000000"):
        out = http.post("/v1/systemone", json=request_body(1, calibration=other))
        assert out.status_code == 422
        error = out.json()["error"]
        assert (error["code"], error["field"]) == ("wrong_calibration", "calibration")
        assert version in error["message"] and other in error["message"]


def test_a_batch_item_for_another_calibration_fails_alone(http, calibrated):
    version = calibrated.calibration.version
    body = {"requests": [request_body(1), request_body(2, calibration="none"),
                         request_body(3, calibration=version)]}
    out = http.post("/v1/systemone/batch", json=body)
    assert out.status_code == 200
    results = out.json()["results"]
    assert results[1]["error"]["code"] == "wrong_calibration"
    assert results[0]["answers"] == same(calibrated.decide(request_body(1)))["answers"]
    assert results[2]["answers"] == same(calibrated.decide(request_body(3)))["answers"]
    shared = http.post("/v1/systemone/batch", json={"state": ["a", "b"], "questions":
                                                    request_body()["questions"], "calibration": "none"})
    assert [r["error"]["code"] for r in shared.json()["results"]] == ["wrong_calibration"] * 2

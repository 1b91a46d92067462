"""Several fine-tunes served from one tower: a request's ``model`` picks the base or a fine-tune,
``/v1/models`` lists them, batches may mix them, another name is answered by the default with a
warning (a 404 under ``--strict``) and the others go on.

Every answer must equal the one a process that loaded only that fine-tune gives.
"""

import httpx
import pytest

from clef_gguf import Clef
from server_helpers import DEADLINE_S, ThreadServer, request_body, same, serve_process, wait_healthy


@pytest.fixture(scope="module")
def alone(tiny_model_dir, tiny_fine_tunes):
    """name -> the responses of a Clef that loaded only that model, for bodies 0..5."""
    out = {}
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as base:
        out[base.provenance.model_name] = [same(base.decide(request_body(i))) for i in range(6)]
    for name, directory in tiny_fine_tunes.items():
        with Clef.load(tiny_model_dir, max_length=2048, threads=2, adapters=directory) as only:
            out[name] = [same(only.decide(request_body(i, model=name))) for i in range(6)]
    return out


@pytest.fixture(scope="module")
def served(tiny_model_dir, tiny_fine_tunes):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2, adapters=tiny_fine_tunes) as clef:
        yield clef


@pytest.fixture(scope="module")
def http(served):
    with ThreadServer(served, max_batch=16) as srv, \
            httpx.Client(base_url=srv.url, timeout=DEADLINE_S) as client:
        yield client


def test_models_lists_the_base_and_each_fine_tune(http, served):
    models = http.get("/v1/models").json()["models"]
    base = served.provenance.model_name
    assert [m["name"] for m in models] == [base, "a", "b"]
    assert [m["default"] for m in models] == [True, False, False]
    assert models[1]["fine_tune"]["name"] == "a" and models[1]["model_hash"] != models[2]["model_hash"]


def test_interleaved_requests_answer_as_alone(http, served, alone):
    base = served.provenance.model_name
    order = ["a", base, "b", "a", None, "b", "a", base]
    for i, name in enumerate(order):
        body = request_body(i % 6, **({"model": name} if name else {}))
        out = http.post("/v1/systemone", json=body)
        assert out.status_code == 200, out.text
        want = alone[name or base][i % 6]
        assert same(out.json()) == want | ({} if name else {"model": base})


def test_workers_ai_path_names_a_fine_tune(http, served, alone):
    """Workers AI's run route: a served fine-tune named in the path answers, whatever the body's
    selector says (clients fix it to clef-flash); the family's name in the path leaves the body's."""
    for i, name in enumerate(("a", "b")):
        body = request_body(i) | {"model": "clef-flash"}
        out = http.post(f"/client/v4/accounts/x/ai/run/@cf/cloudflare/{name}", json=body)
        assert out.status_code == 200, out.text
        assert same(out.json()["result"]) == alone[name][i]
    out = http.post("/accounts/x/ai/run/@cf/cloudflare/clef-flash", json=request_body(2, model="a"))
    assert same(out.json()["result"]) == alone["a"][2]


def test_a_batch_mixes_fine_tunes(http, served, alone):
    base = served.provenance.model_name
    names = ["b", "a", base, "a", "b", base]
    body = {"requests": [request_body(i, model=name) for i, name in enumerate(names)]}
    out = http.post("/v1/systemone/batch", json=body)
    assert out.status_code == 200, out.text
    results = out.json()["results"]
    for i, (name, result) in enumerate(zip(names, results)):
        assert result["answers"] == alone[name][i]["answers"]
        assert result["model"] == name and result["model_hash"] == alone[name][i]["audit"]["model_hash"]


def test_another_model_name_is_answered_by_the_default_and_the_others_go_on(http, served, alone):
    base = served.provenance.model_name
    for name in ("nope", "clef-flash"):
        out = http.post("/v1/systemone", json=request_body(1, model=name))
        assert out.status_code == 200, out.text
        got = out.json()
        assert got["answers"] == alone[base][1]["answers"] and got["model"] == name
        assert got["warnings"][0]["code"] == "unknown_model" and "a, b" in got["warnings"][0]["message"]
    batch = http.post("/v1/systemone/batch",
                      json={"requests": [request_body(2, model="nope"), request_body(3, model="a")]})
    assert batch.status_code == 200
    first, second = batch.json()["results"]
    assert first["answers"] == alone[base][2]["answers"] and second["answers"] == alone["a"][3]["answers"]
    assert same(http.post("/v1/systemone", json=request_body(4, model="b")).json()) == alone["b"][4]


def test_under_strict_another_model_name_is_404_and_the_others_go_on(tiny_model_dir, tiny_fine_tunes, alone):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2, adapters=tiny_fine_tunes, strict=True) as strict, \
            ThreadServer(strict, max_batch=16) as srv, httpx.Client(base_url=srv.url, timeout=DEADLINE_S) as http:
        out = http.post("/v1/systemone", json=request_body(1, model="nope"))
        assert out.status_code == 404
        error = out.json()["error"]
        assert (error["code"], error["field"]) == ("unknown_model", "model") and "a, b" in error["message"]
        batch = http.post("/v1/systemone/batch",
                          json={"requests": [request_body(2, model="nope"), request_body(3, model="a")]})
        assert batch.status_code == 200
        first, second = batch.json()["results"]
        assert first["error"]["code"] == "unknown_model" and second["answers"] == alone["a"][3]["answers"]


@pytest.mark.slow
def test_serve_flags(tmp_path, tiny_model_dir, tiny_fine_tunes, alone):
    """``clef-gguf serve --adapter NAME=DIR`` twice, as a user starts it; a bad flag is exit 2."""
    flags = [f"--adapter=a={tiny_fine_tunes['a']}", f"--adapter=b={tiny_fine_tunes['b']}"]
    with serve_process(tmp_path, "--model", str(tiny_model_dir), "--threads", "2", "--max-length", "2048",
                       *flags) as (proc, url, _):
        wait_healthy(proc, url)
        names = [m["name"] for m in httpx.get(f"{url}/v1/models", timeout=DEADLINE_S).json()["models"]]
        assert names[1:] == ["a", "b"]
        for name in ("b", "a"):
            out = httpx.post(f"{url}/v1/systemone", json=request_body(5, model=name), timeout=DEADLINE_S)
            assert same(out.json()) == alone[name][5]
    with serve_process(tmp_path, "--model", str(tiny_model_dir), f"--adapter=a={tiny_fine_tunes['a']}",
                       f"--adapter=a={tiny_fine_tunes['b']}") as (proc, url, _):
        assert proc.wait(DEADLINE_S) == 2


def test_a_real_client_naming_the_family_gets_the_served_fine_tune(tiny_model_dir, tiny_fine_tunes, alone):
    """avrik-sdk sends the model name its user gives, as Workers AI clients send "clef-flash": a server
    started with one --adapter DIR answers it with that fine-tune (the reference ignores ``model``)."""
    from avrik_sdk import Client

    body = request_body(2)
    with Clef.load(tiny_model_dir, max_length=2048, threads=2, adapters=tiny_fine_tunes["a"]) as only_a, \
            ThreadServer(only_a) as srv, Client(srv.url, timeout=DEADLINE_S) as client:
        for name in ("clef-flash", "@cf/cloudflare/clef-flash", "a"):
            decision = client.decide(body["state"], body["questions"], model=name)
            got = decision.model_dump(exclude_none=True, exclude_defaults=True)
            assert got["answers"] == alone["a"][2]["answers"] and decision.model == name
            assert decision.audit.model_hash == alone["a"][2]["audit"]["model_hash"]

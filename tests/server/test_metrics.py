"""``server.metrics``: ``GET /metrics`` of a real uvicorn server after real requests, parsed with
prometheus-client's own parser, counts exactly what was sent."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import DEADLINE_S, Gated, ThreadServer, request_body

KEY = {"Authorization": "Bearer k"}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels) -> value."""
    got = httpx.get(f"{url}/metrics", headers=KEY, timeout=DEADLINE_S)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(got.text) for s in family.samples}


def value(samples: dict, metric: str, **labels: str) -> float:
    return samples.get((metric, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def srv(clef):
    with ThreadServer(Gated(clef), api_key="k") as server:
        server.wait_loaded()
        yield server


def test_metrics_count_what_was_sent(srv, clef):
    url = srv.url
    before = scrape(url)
    answers = [httpx.post(f"{url}/v1/systemone", json=request_body(i), headers=KEY, timeout=DEADLINE_S)
               for i in (1, 2, 1)]  # the third repeats the first: its state comes from the cache
    assert [a.status_code for a in answers] == [200, 200, 200]
    run = httpx.post(f"{url}/client/v4/accounts/a/ai/run/@cf/cloudflare/clef-flash",
                     json=request_body(3), headers=KEY, timeout=DEADLINE_S)
    assert run.status_code == 200
    bad = httpx.post(f"{url}/v1/systemone", json={"state": "x", "questions": {"q": {"type": "maybe"}}},
                     headers=KEY, timeout=DEADLINE_S)
    assert bad.status_code == 422
    forged = httpx.post(f"{url}/v1/systemone", json=request_body(1),
                        headers={**KEY, "Host": "evil.example"}, timeout=DEADLINE_S)
    assert forged.status_code == 421
    keyless = httpx.post(f"{url}/v1/systemone", json=request_body(1), timeout=DEADLINE_S)
    assert keyless.status_code == 401
    after = scrape(url)

    def delta(metric: str, **labels: str) -> float:
        return value(after, metric, **labels) - value(before, metric, **labels)

    assert delta("clef_requests_total", route="/v1/systemone", method="POST", status="200") == 3
    assert delta("clef_requests_total", route="/client/v4/accounts/{account_id}/ai/run/{model:path}",
                 method="POST", status="200") == 1
    assert delta("clef_requests_total", route="/v1/systemone", method="POST", status="422") == 1
    # refused before routing: one label for all of them, never the path a client made up
    assert delta("clef_requests_total", route="other", method="POST", status="421") == 1
    assert delta("clef_requests_total", route="other", method="POST", status="401") == 1
    assert delta("clef_errors_total", code="invalid_question_type") == 1
    assert delta("clef_errors_total", code="host_not_allowed") == 1  # the guard's refusals too
    assert delta("clef_errors_total", code="unauthorized") == 1
    usages = [a.json()["usage"] for a in answers] + [run.json()["result"]["usage"]]
    assert delta("clef_input_tokens_total") == sum(u["input_tokens"] for u in usages)
    assert delta("clef_cached_tokens_total") == sum(u["cached_tokens"] for u in usages) > 0
    for stage in ("prepare", "queue", "tower", "head"):
        assert delta("clef_stage_seconds_count", stage=stage) == 4, stage
        assert delta("clef_stage_seconds_sum", stage=stage) >= 0
    assert delta("clef_request_seconds_count", route="/v1/systemone") == 4
    assert value(after, "clef_request_seconds_bucket", route="/v1/systemone", le="+Inf") == \
        value(after, "clef_request_seconds_count", route="/v1/systemone")
    assert value(after, "clef_queue_depth") == 0 and value(after, "clef_model_busy") == 0
    assert value(after, "clef_models_loaded") == 1
    info = {labels: v for (metric, labels), v in after.items() if metric == "clef_model_info"}
    assert info == {(("backend", str(clef.info["backend"])), ("default", "true"),
                     ("name", clef.info["name"]), ("precision", str(clef.info["precision"]))): 1.0}


def test_metrics_are_behind_the_key(srv):
    refused = httpx.get(f"{srv.url}/metrics", timeout=DEADLINE_S)
    assert (refused.status_code, refused.json()["error"]["code"]) == (401, "unauthorized")
    assert httpx.get(f"{srv.url}/metrics", headers={"X-API-Key": "k"}, timeout=DEADLINE_S).status_code == 200


def test_metrics_while_loading_say_no_model(clef):
    import threading

    release = threading.Event()

    def slow_load():
        release.wait(DEADLINE_S)
        return Gated(clef)

    with ThreadServer(slow_load) as server:
        text = httpx.get(f"{server.url}/metrics", timeout=DEADLINE_S).text
        release.set()
        server.wait_loaded()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["clef_models_loaded"] == 0 and "clef_model_info" not in samples

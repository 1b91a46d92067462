"""The API fuzzed with schemathesis from its own ``/openapi.json``: a real uvicorn server on
127.0.0.1 serving the real tiny model, every operation, schemathesis's examples, coverage and
fuzzing phases, positive and negative data.

Checked for every response: no status >= 500; status, content type, headers and body as
documented; and every 4xx/5xx body exactly ``{"error": {"code": str, "message": str,
"field": str | null}}``. Not checked: ``positive_data_acceptance`` (the schema cannot say
everything the server refuses: lone surrogates, prompts too long for the window, instructions
that render to no tokens) and ``negative_data_rejection`` (a batch answers 200 with each refused
input's error inside, by design).

Failures do not stop the run: each distinct one (operation, check, status, error code) is kept
with a curl line to reproduce it, and ``test_fuzzing_found_no_failure`` (after the fuzzing in
this file) reports them all with the number of cases run.

``CLEF_FUZZ_CASES`` (default 400, about 30 s on 2 cores) is the number of generated cases
across the two POST operations; the full run: ``CLEF_FUZZ_CASES=10000 python -m pytest -s
tests/server/test_server_fuzz.py``.
"""

import collections
import json
import os
from dataclasses import dataclass, field

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi import checks as openapi_checks

from clef_gguf import Clef
from server_helpers import DEADLINE_S, ThreadServer

CASES = int(os.environ.get("CLEF_FUZZ_CASES", "400"))
FUZZED_POSTS = 3  # the GETs take no input: one case each
CHECKS = [schemathesis.checks.not_a_server_error, openapi_checks.status_code_conformance,
          openapi_checks.content_type_conformance, openapi_checks.response_headers_conformance,
          openapi_checks.response_schema_conformance, openapi_checks.unsupported_method]


def error_body_shape(_ctx, response, case) -> None:
    """Every refusal, documented or not (404, 405...), in the API's one error shape (Workers AI's
    run route: in its envelope, one error with an integer code)."""
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: "
                             f"{response.content[:200]!r}") from None
    if "/ai/run/" in case.operation.path:
        errors = body.get("errors") if isinstance(body, dict) else None
        if not (isinstance(body, dict) and body.get("success") is False and body.get("result") is None
                and isinstance(errors, list) and len(errors) == 1
                and isinstance(errors[0].get("code"), int) and isinstance(errors[0].get("message"), str)):
            raise AssertionError(f"{response.status_code} body is not Workers AI's refusal: "
                                 f"{response.content[:300]!r}")
        return
    err = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict)
            and set(err) == {"code", "message", "field"} and isinstance(err["code"], str)
            and err["code"] and isinstance(err["message"], str)
            and (err["field"] is None or isinstance(err["field"], str))):
        raise AssertionError(f"{response.status_code} body is not the API's error shape: "
                             f"{response.content[:300]!r}")


@dataclass
class Found:
    cases: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: dict = field(default_factory=dict)  # key -> (count, curl, status, body, message)

    def record(self, case, response, group: FailureGroup | None) -> None:
        self.cases += 1
        label = case.operation.label
        code = None
        if response.status_code >= 400:
            try:
                body = json.loads(response.content)
                code = body["error"]["code"] if "error" in body else body["errors"][0]["code"]
            except (ValueError, KeyError, TypeError, IndexError):
                code = "<not the error shape>"
        self.statuses[(label, response.status_code, code)] += 1
        for failure in group.exceptions if group is not None else ():
            key = (label, type(failure).__name__, response.status_code, code)
            count, *first = self.failures.get(key, (0, case.as_curl_command(),
                                                    response.status_code,
                                                    response.content[:500],
                                                    failure.message or failure.title))
            self.failures[key] = (count + 1, *first)

    def report(self) -> str:
        lines = [f"fuzz: {self.cases} cases (CLEF_FUZZ_CASES={CASES})"]
        lines += [f"fuzz:   {label} -> {status} {code or ''}: {n}"
                  for (label, status, code), n in sorted(self.statuses.items(), key=str)]
        for (label, check, status, code), (n, curl, _s, body, message) in self.failures.items():
            lines += [f"FAILURE {label} {check} ({status} {code}) x{n}: {message}",
                      f"    {curl}", f"    -> {body!r}"]
        return "\n".join(lines)


FOUND = Found()


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    # A small window keeps each generated prompt's pass short; max_batch bounds a batch's work.
    with Clef.load(tiny_model_dir, max_length=1024, threads=2) as clef, \
            ThreadServer(clef, max_batch=4, max_body_bytes=256 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", timeout=DEADLINE_S)


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@schema.parametrize()
@settings(max_examples=max(1, -(-CASES // FUZZED_POSTS)), deadline=None, database=None,
          derandomize=False, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_fuzz_the_api(case, fuzz_server):
    response = case.call(base_url=fuzz_server.url, timeout=DEADLINE_S)
    try:
        case.validate_response(response, checks=CHECKS, additional_checks=[error_body_shape],
                               transport_kwargs={"base_url": fuzz_server.url})
    except FailureGroup as group:  # kept, not raised: one run finds every distinct failure
        FOUND.record(case, response, group)
    else:
        FOUND.record(case, response, None)


def test_fuzzing_found_no_failure():
    print("\n" + FOUND.report())
    assert FOUND.cases >= CASES, "the fuzzing above did not run (run the whole file)"
    assert not FOUND.failures, FOUND.report()

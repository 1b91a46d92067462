"""Workers AI's run endpoint, so that clients written for Cloudflare's hosted Clef run against this
server by changing their base URL: ``POST {base}/accounts/{account_id}/ai/run/@cf/cloudflare/{model}``
with ``base`` either ``http://HOST:PORT/client/v4`` (Cloudflare's own path) or ``http://HOST:PORT``.

The body is SystemOne's (``state``, ``questions``, ``images`` as data URIs or Workers AI's
``{"content_type", "base64"}`` objects, which the request stage reads), so a request runs exactly as on
``/v1/systemone``: the same queue, caches, limits and checks. Only the wrapping differs: the answer is
``{"result": <the SystemOne response>, "success": true, "errors": [], "messages": []}``; a refusal
keeps the HTTP status ``/v1/systemone`` gives it (Cloudflare's SDKs ignore ``success`` on a 200) with
``{"result": null, "success": false, "errors": [{"code": <int>, "message", "field"?}], "messages": []}``.

The account id is accepted and ignored. Which model answers: a model this server serves named in the
path (``@cf/cloudflare/my-fine-tune``) wins; otherwise the body's ``model`` selector (``clef``,
``clef-flash``), else the path's name, routed as ``/v1/systemone`` routes a request's ``model``.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from starlette.responses import Response

from clef_gguf.core import errors
from clef_gguf.core.errors import ClefError
from clef_gguf.server.http import json_response

PATHS = ("/client/v4/accounts/{account_id}/ai/run/{model:path}",
         "/accounts/{account_id}/ai/run/{model:path}")
_RUN_PATH = re.compile(r"^(?:/client/v4)?/accounts/[^/]+/ai/run/")
MODEL_PREFIX = "@cf/cloudflare/"

# Our error codes as the integers Workers AI clients read in ``errors[].code``, by the kind of
# refusal (Workers AI's own numbers where it has one: 5006 bad input, 5007 no such model, 5021 the
# context window, 3040 out of capacity, 3043 an internal error; 10000 Cloudflare's authentication
# error). A code missing here falls back to its HTTP status's row in ``BY_STATUS``.
BY_CODE = {"context_too_large": 5021, "unknown_model": 5007, "unauthorized": 10000,
           "inference_error": 3043, "internal_error": 3043}
BY_STATUS = {400: 5006, 403: 10001, 404: 5007, 405: 5006, 413: 5006, 415: 5006, 421: 10001,
             422: 5006, 429: 3040, 499: 3043, 500: 3043, 503: 3040}
UNKNOWN = 3043


def is_run_path(path: str) -> bool:
    return _RUN_PATH.match(path) is not None


def code_of(error: ClefError) -> int:
    """The integer code a Workers AI client reads for ``error``."""
    return BY_CODE.get(error.code) or BY_STATUS.get(error.status, UNKNOWN)


def answer(body: Any, headers: dict[str, str] | None = None) -> Response:
    return json_response({"result": body, "success": True, "errors": [], "messages": []},
                         headers=headers)


def refuse(error: ClefError) -> Response:
    """Workers AI's failure envelope, with the status and headers (``Retry-After``,
    ``WWW-Authenticate``) this server gives the error everywhere."""
    detail: dict[str, Any] = {"code": code_of(error), "message": error.message}
    if error.field is not None:
        detail["field"] = error.field
    return json_response({"result": None, "success": False, "errors": [detail], "messages": []},
                         error.status, error.headers)


def systemone_body(body: Any, path_model: str, served: Collection[str]) -> dict[str, Any]:
    """The Workers AI body as the SystemOne request it is: the model that answers chosen (see the
    module); everything else as sent."""
    if not isinstance(body, dict):
        raise errors.InvalidValue("the body must be a JSON object with state and questions")
    name = path_model.removeprefix(MODEL_PREFIX)
    if not name or "/" in name:
        raise errors.NotFound(f"no model {path_model!r} here; use @cf/cloudflare/clef-flash, "
                              f"@cf/cloudflare/clef or a served model's name", field="model")
    selector = body.get("model")
    if name in served or selector is None:
        return {**body, "model": name}
    return dict(body)

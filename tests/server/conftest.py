"""Fixtures the server tests share: the tiny model, served in a thread, and a client for it.

``clef``    the f32 tiny model (window 2,048 tokens, 2 threads), loaded once per module
``server``  ``clef`` served by uvicorn in a thread (``server_helpers.ThreadServer``), batches of 8
``http``    an httpx client of ``server``
A module that needs another model or server defines its own fixture of the same name.
"""

import httpx
import pytest

from clef_gguf import Clef
from server_helpers import DEADLINE_S, ThreadServer


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as model:
        yield model


@pytest.fixture(scope="module")
def server(clef):
    with ThreadServer(clef, max_batch=8) as srv:
        yield srv


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as client:
        yield client

"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 (in a thread or a process),
and a wrapper that can hold the model's forward pass so queue states are reached exactly.

Every wait is a bounded poll that stops on its own; no assertion depends on elapsed time. A wait
for something to start (a server process, its model, Ray Serve's replicas, a uvicorn thread) follows
that thing, not a clock: it lasts as long as the process runs and is still starting, so a loaded
machine waits longer and a crash fails at once with the process's output (``wait_while_starting``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from clef_gguf.server.app import create_app
from clef_gguf.server.http import free_port


def same(response) -> dict:
    """A response as it must be whatever was served before: all but ``usage.cached_tokens`` (and
    ``cached_media_tokens``), which say what the caches held (a body, bytes or a parsed dict)."""
    out = json.loads(response) if isinstance(response, (bytes, str)) else dict(response)
    out["usage"] = {k: v for k, v in out["usage"].items() if k not in ("cached_tokens", "cached_media_tokens")}
    return out

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0  # an upper bound for "should happen": reached only when something is stuck
# The last resort against a hang, never the measure of "started": a start is waited for while its
# process runs (``wait_while_starting``); only one that runs on and never gets ready meets this.
HANG_CAP_S = 600.0

NOUL = {"type": "noul", "instructions": "Is this urgent?"}
CHOICE = {"type": "choice", "instructions": "Which team?",
          "criteria": {"billing": "Payments and refunds", "tech": None, "sales": "New deals"}}
SCORE = {"type": "score", "instructions": "How angry is the customer?",
         "criteria": ["calm", "annoyed", "furious"]}
QUESTIONS = {"urgent": NOUL, "team": CHOICE, "anger": SCORE}


def request_body(i: int = 0, **extra) -> dict:
    """A valid request whose state (and so whose answers) depends on ``i``."""
    return {"state": {"ticket": f"Refund {i} not received after {i % 30} days",
                      "amount": 10.5 * i}, "questions": QUESTIONS, **extra}


def wait_for(predicate, what: str, deadline: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def until(predicate, what: str, deadline: float = DEADLINE_S) -> None:
    """``wait_for`` on an event loop: poll ``predicate`` between turns of the loop's other tasks
    until it holds (an explicit state, never "after one ``sleep(0)``"); bounded."""
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def wait_while_starting(ready, what: str, *, alive, report, cap: float = HANG_CAP_S) -> None:
    """Poll ``ready()`` for as long as ``alive()`` (the process or thread that is starting still
    runs). Once it has stopped without being ready, fail at once with ``report()`` (its exit status
    and output). ``cap`` is only the last resort against one that runs on and never gets ready."""
    end = time.monotonic() + cap
    while not ready():
        if not alive():
            if ready():  # it got there just before it ended (a load thread, say)
                return
            raise AssertionError(f"{what}: it stopped before that happened. {report()}")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: still running but not there after {cap:.0f} s, the "
                                 f"last-resort cap against a hang (HANG_CAP_S). {report()}")
        time.sleep(0.05)


def wait_process_ready(proc: subprocess.Popen, ready, what: str) -> None:
    """``wait_while_starting`` for a child process whose output is in ``proc.log_path`` (as
    ``serve_process`` makes them): waits while it runs, fails with its output once it exits."""
    def report() -> str:
        state = ("still running" if proc.returncode is None
                 else f"exit status {proc.returncode}")
        return f"The process: {state}; its output:\n{server_log(proc)}"

    wait_while_starting(ready, what, alive=lambda: proc.poll() is None, report=report)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Gated:
    """A ``Clef`` whose ``run`` waits for ``gate`` (open by default) and counts passes."""

    def __init__(self, clef) -> None:
        self.clef = clef
        self.info, self.provenance = clef.info, getattr(clef, "provenance", None)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = 0  # passes that reached run()
        self.runs = 0  # passes completed
        self._lock = threading.Lock()

    @property
    def models(self):
        return {self.info["name"]: self}

    def prepare(self, *args, **kwargs):
        return self.clef.prepare(*args, **kwargs)

    def run(self, prepared):
        with self._lock:
            self.entered += 1
        self.gate.wait(DEADLINE_S)  # bounded: a failing test cannot hang the worker forever
        out = self.clef.run(prepared)
        with self._lock:
            self.runs += 1
        return out

    def close(self) -> None:
        pass


class ThreadServer:
    """``create_app(...)`` served by uvicorn in a thread, on a free loopback port."""

    def __init__(self, model, **app_kwargs) -> None:
        self.app = create_app(model, **app_kwargs)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_config=None,
                                access_log=False, lifespan="on", timeout_graceful_shutdown=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def queue(self):
        return self.app.state.queue

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_while_starting(lambda: self.server.started, "uvicorn to start",
                            alive=self.thread.is_alive,
                            report=lambda: "The server thread ended (its error is logged above).")
        assert self.server.started, "uvicorn did not start"
        return self

    def wait_loaded(self) -> None:
        """Until the model's background load has ended (``ok`` or ``error``: the caller checks
        which), for as long as that load runs."""
        served = self.app.state.served
        wait_while_starting(lambda: served.status != "loading", "the model to load",
                            alive=lambda: self.thread.is_alive() and served.still_loading,
                            report=lambda: "The load thread or the server ended while loading.")

    def stop(self) -> None:
        self.server.should_exit = True  # what SIGINT/SIGTERM set
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "server did not stop"

    def __exit__(self, *_exc) -> None:
        if self.thread.is_alive():
            self.stop()


SERVE = ("-m", "clef_gguf.server")
GATED_SERVE = (str(Path(__file__).with_name("gated_serve.py")),)  # + GATE_DIR: held passes


@contextlib.contextmanager
def serve_process(tmp_path: Path, *args: str, env: dict | None = None,
                  entry: tuple[str, ...] = SERVE):
    """``python -m clef_gguf.server ARGS --port P`` as a child process; yields (proc, url, port).
    ``entry=(*GATED_SERVE, gate_dir)`` runs the same command with its passes held on files.

    Its output goes to a file (``proc.log_path``): a pipe nobody reads would fill up with the
    per-request log lines and block the server.
    """
    port = free_port()
    cmd = [sys.executable, *entry, *args, "--host", "127.0.0.1", "--port", str(port)]
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
    proc.log_path = log_path
    try:
        yield proc, f"http://127.0.0.1:{port}", port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(DEADLINE_S)


def server_log(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()


def wait_healthy(proc: subprocess.Popen, url: str) -> None:
    """Until ``GET /health`` answers 200, for as long as the server process runs and is still
    starting: its port not open yet (or too busy to answer within 5 s), its model ``loading``, or
    Ray Serve's proxy up before its replicas. An exited process, or a /health that reports the load
    failed, fails at once with the process's output; ``HANG_CAP_S`` only caps a hang."""
    def ok() -> bool:
        try:
            health = httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            return False
        if health.status_code == 200:
            return True
        try:
            body = health.json()
        except ValueError:  # not our app's answer yet (Ray Serve's proxy before the replicas)
            return False
        if isinstance(body, dict) and body.get("status") == "error":
            raise AssertionError(f"the server's model failed to load: {health.text}\n"
                                 f"{server_log(proc)}")
        return False

    wait_process_ready(proc, ok, "the server's /health to say ok")


def raw_post(port: int, body: bytes) -> socket.socket:
    """A POST on a bare socket, left open: the test decides when the client goes away."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (port, len(body), body))
    return sock


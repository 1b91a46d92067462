"""``clef-gguf mcp`` as an agent runs it: a child process on stdin/stdout, driven by the MCP SDK's own
client (``ClientSession`` over ``stdio_client``), its answers checked against ``clef-gguf decide`` and
``GET /v1/models`` of ``clef-gguf serve``, each a process of its own with the same flags.

One server process serves the module (a base, two fine-tunes, a picture directory opened with
``--media-allow-files``); its session lives in a blocking portal, so the tests stay synchronous.
Two more processes: the raw protocol on pipes (nothing but JSON-RPC on stdout, under ``-v``, with
the default picture policy) and one without the SDK."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import PIL.Image
import pytest
from anyio.from_thread import start_blocking_portal
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from clef_gguf import cli
from clef_gguf.agent.mcp_server import summary
from clef_gguf.pipeline.wire import SystemOneRequest

TIMEOUT_S = 300.0  # a bound for a hang; a start on a loaded 2-core machine takes seconds
# The same load flags for every process compared. The state cache is off: `usage.cached_tokens` says
# what a warm process had cached (the module's server has decided before; a CLI process never has),
# and only with it off are the two responses the same bytes.
LOAD = ["--threads", "1", "--state-cache-mb", "0", "--max-length", "1024"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
QUESTIONS = {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
             "team": {"type": "choice", "instructions": "Which team?",
                      "criteria": {"billing": "Payments and refunds", "tech": None, "sales": "New deals"}},
             "anger": {"type": "score", "instructions": "How angry is the customer?",
                       "criteria": ["calm", "annoyed", "furious"]}}
REQUEST = {"state": {"ticket": "Refund for order 1182 not received after 40 days", "amount": 10.5},
           "questions": QUESTIONS, "id": "ticket-7"}  # `id`: not SystemOne, named in `warnings`


def _png(path: Path, seed: int) -> Path:
    PIL.Image.frombytes("RGB", (32, 24), bytes((seed * 7 + i) % 256 for i in range(32 * 24 * 3))).save(path)
    return path


def _cli(*args: str | Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clef_gguf.cli", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)


def cli_decide(request: dict, flags: list[str]) -> dict:
    """What `clef-gguf decide` prints for ``request``."""
    proc = _cli("decide", *flags, stdin=json.dumps(request))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


class Client:
    """The SDK's session, called from synchronous tests through the portal's event loop."""

    def __init__(self, portal, session: ClientSession, errlog: Path) -> None:
        self.portal, self.session, self.errlog = portal, session, errlog

    def call(self, name: str, arguments: dict):
        return self.portal.call(self.session.call_tool, name, arguments)

    def tools(self):
        return {t.name: t for t in self.portal.call(self.session.list_tools).tools}


@contextlib.asynccontextmanager
async def _connect(args: list[str], errlog: io.TextIOWrapper) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "clef_gguf.cli", *args], env=ENV)
    async with stdio_client(params, errlog=errlog) as (read, write):
        async with ClientSession(read, write, read_timeout_seconds=TIMEOUT_S) as session:
            await session.initialize()
            yield session


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pictures")
    (root / "allowed").mkdir()
    (root / "outside").mkdir()
    return {"allowed_dir": root / "allowed", "inside": _png(root / "allowed" / "a.png", 1),
            "outside": _png(root / "outside" / "b.png", 2)}


@pytest.fixture(scope="module")
def flags(tiny_model_dir, tiny_fine_tunes) -> list[str]:
    """The model flags of every process compared: the tiny base and two fine-tunes."""
    return ["--model", str(tiny_model_dir), "--adapter", f"a={tiny_fine_tunes['a']}",
            "--adapter", f"b={tiny_fine_tunes['b']}", *LOAD]


@pytest.fixture(scope="module")
def client(flags, pictures, tmp_path_factory):
    errlog = tmp_path_factory.mktemp("mcp") / "stderr.txt"
    args = ["mcp", *flags, "--media-allow-files", str(pictures["allowed_dir"])]
    with open(errlog, "w") as err, start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(_connect(args, err)) as session:
        yield Client(portal, session, errlog)


# ---------------------------------------------------------------- the command
def test_help_explains_the_command():
    parser = cli.build_parser("mcp")
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["mcp"].format_help()
    for words in ("Model Context Protocol", "stdin/stdout", "claude_desktop_config.json", '"mcpServers"',
                  "decide", "models", "--media-allow-files", "--adapter", "pip install 'clef-gguf[mcp]'"):
        assert words in text, words


@pytest.mark.parametrize("installed, says", [
    (None, "mcp is not installed"),
    ("1.30.0", "clef-gguf mcp needs the mcp SDK 2.x (found 1.30.0)"),
])
def test_without_the_sdk_the_command_says_how_to_install_it(tmp_path, installed, says):
    # An `mcp` first on the path: one that cannot be imported (the extra not installed), or the 1.x
    # SDK's distribution (another API).
    (tmp_path / "mcp").mkdir()
    (tmp_path / "mcp" / "__init__.py").write_text("" if installed else "raise ImportError('No module named mcp')\n")
    if installed:
        (tmp_path / f"mcp-{installed}.dist-info").mkdir()
        (tmp_path / f"mcp-{installed}.dist-info" / "METADATA").write_text(f"Name: mcp\nVersion: {installed}\n")
    proc = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "mcp", "--model", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**ENV, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    error = json.loads(proc.stdout)["error"]  # refused before the (missing) model is looked at
    assert error["code"] == "missing_dependency"
    assert error["message"] == f"{says}: pip install 'clef-gguf[mcp]'" and "Traceback" not in proc.stderr


def test_a_picture_directory_that_is_none_is_refused_before_the_load(tmp_path):
    proc = _cli("mcp", "--model", tmp_path / "none", "--media-allow-files", tmp_path / "nowhere")
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["error"] == {
        "code": "invalid_setting", "field": "media_allow_files",
        "message": f"--media-allow-files {str(tmp_path / 'nowhere')!r} is not a directory"}


# ---------------------------------------------------------------- the tools
def test_it_lists_decide_and_models_with_their_input_schemas(client):
    tools = client.tools()
    assert sorted(tools) == ["decide", "models"]
    decide = tools["decide"]
    # The request's own wire model: the arguments are a SystemOne request.
    assert decide.input_schema == SystemOneRequest.model_json_schema()
    assert decide.input_schema["required"] == ["state", "questions"]
    assert {"state", "questions", "images", "model", "options"} <= set(decide.input_schema["properties"])
    assert "noul" in decide.description and "choice" in decide.description and "score" in decide.description
    assert tools["models"].input_schema == {"type": "object", "properties": {}, "additionalProperties": False}
    assert all(t.annotations.read_only_hint for t in tools.values())


def test_decide_answers_what_the_cli_answers(client, flags):
    result = client.call("decide", REQUEST)
    assert not result.is_error, result.content
    want = cli_decide(REQUEST, flags)
    assert json.dumps(result.structured_content) == json.dumps(want)
    text, as_json = (block.text for block in result.content)
    assert json.loads(as_json) == want
    assert text == summary(want)
    lines = text.splitlines()
    assert re.fullmatch(r"urgent: noul 0\.\d{1,4}", lines[0])
    assert re.fullmatch(r"team: choice (billing|tech|sales) \(0\.\d{1,4}\)", lines[1])
    assert re.fullmatch(r"anger: score [0-2]\.\d{1,4} \((calm|annoyed|furious), 0\.\d{1,4}\)", lines[2])
    assert lines[3:] == [f"model: {want['model']}",
                         f"warning: ignored_field (id): {want['warnings'][0]['message']}"]


def test_a_fine_tune_with_a_picture_and_options_answers_what_the_cli_answers(client, flags, pictures):
    request = {"state": "late " * 1500, "questions": QUESTIONS, "model": "a",
               "images": [str(pictures["inside"])], "options": {"truncate_state": True}}
    result = client.call("decide", request)
    assert not result.is_error, result.content
    want = cli_decide(request, flags)
    assert json.dumps(result.structured_content) == json.dumps(want)
    assert want["audit"]["fine_tune"]["name"] == "a" and want["truncated"] is True
    assert "truncated: the state was cut to fit the window" in result.content[0].text


def test_models_lists_what_get_v1_models_lists(client, flags):
    result = client.call("models", {})
    assert not result.is_error, result.content
    listing = result.structured_content
    assert [(m["name"], m["default"]) for m in listing["models"]][1:] == [("a", False), ("b", False)]
    assert result.content[0].text.splitlines()[1:] == ["a", "b"]
    assert result.content[0].text.splitlines()[0] == f"{listing['models'][0]['name']} (default)"
    assert json.loads(result.content[1].text) == listing
    # the same models as the server lists (the server adds its HTTP limits, which MCP has none of)
    assert listing == {"models": _served_models(flags)["models"]}


def _served_models(flags: list[str]) -> dict:
    """``GET /v1/models`` of `clef-gguf serve` with the same flags."""
    from clef_gguf.server.http import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clef_gguf.cli", "serve", *flags, "--port", str(port),
                             "--no-ui"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S) as http:
            deadline = time.monotonic() + TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/health").status_code == 200:
                        return http.get("/v1/models").json()
                time.sleep(0.2)
        raise AssertionError(f"serve did not start: {proc.poll()}")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, err


@pytest.mark.parametrize("arguments, code, field", [
    ({"state": "x"}, "missing_field", "questions"),
    ({"state": "x", "questions": {"q": {"type": "maybe"}}}, "invalid_question_type", "questions.q.type"),
    ({"state": "x", "questions": {"q": {"type": "choice", "criteria": {}}}}, "invalid_criteria",
     "questions.q.criteria"),
    ({"state": "x", "questions": {"q": {"type": "noul"}}, "images": ["OUTSIDE"]}, "unsupported_media_source",
     "images.0"),
])
def test_a_bad_request_is_a_tool_error_naming_its_code_and_field(client, pictures, arguments, code, field):
    if arguments.get("images") == ["OUTSIDE"]:  # a file outside --media-allow-files' directory
        arguments = {**arguments, "images": [str(pictures["outside"])]}
    result = client.call("decide", arguments)
    assert result.is_error
    assert result.structured_content["error"]["code"] == code
    assert result.structured_content["error"]["field"] == field
    text = result.content[0].text
    assert text.startswith(f"{code}: ") and f"(field: {field})" in text
    assert result.structured_content["error"]["message"] in text
    assert not client.call("models", {}).is_error  # the server lives on


def test_an_unknown_tool_is_a_protocol_error(client):
    with pytest.raises(MCPError, match="unknown tool 'nope'"):
        client.call("nope", {})


# ---------------------------------------------------------------- the channel
def _send(proc: subprocess.Popen, message: dict) -> None:
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()


def _answer(proc: subprocess.Popen, id_: int) -> dict:
    line = proc.stdout.readline()
    message = json.loads(line)  # anything else on stdout fails here: the line is not JSON
    assert message["jsonrpc"] == "2.0" and message["id"] == id_, line
    return message


def test_stdout_carries_only_the_protocol_and_files_are_refused_by_default(tiny_model_dir, pictures):
    # -v: llama.cpp's and the loader's logs at their loudest, all of them on stderr.
    proc = subprocess.Popen([sys.executable, "-m", "clef_gguf.cli", "-v", "mcp", "--model", str(tiny_model_dir),
                             *LOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    try:
        _send(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "claude-ai", "version": "0.1.0"}}})
        assert _answer(proc, 1)["result"]["serverInfo"]["name"] == "clef-gguf"
        _send(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        body = {"state": "A picture.", "questions": {"q": {"type": "noul"}}, "images": [str(pictures["inside"])]}
        _send(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                     "params": {"name": "decide", "arguments": body}})
        refused = _answer(proc, 2)["result"]
        assert refused["isError"] is True  # no --media-allow-files: inline pictures only
        assert refused["structuredContent"]["error"]["code"] == "unsupported_media_source"
        _send(proc, {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                     "params": {"name": "decide", "arguments": REQUEST}})
        answered = _answer(proc, 3)["result"]
        assert answered.get("isError") is not True and set(answered["structuredContent"]["answers"]) == set(QUESTIONS)
        proc.stdin.close()  # the client leaves: the server ends cleanly, writing nothing more
        rest, err = proc.stdout.read(), proc.stderr.read()
        assert proc.wait(TIMEOUT_S) == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT_S)
    assert rest == ""
    assert "llama" in err and err.count("loaded tower") == 1  # the logs went to stderr; one load


def test_a_capacity_refusal_says_the_words_clients_read(client):
    from clef_gguf.core.refusals import KIT_PHRASES

    too_many = {"type": "choice", "criteria": {f"o{i}": f"option {i}" for i in range(256)}}
    for arguments, code in [({"state": "word " * 3000, "questions": {"q": {"type": "noul"}}}, "context_too_large"),
                            ({"state": "x", "questions": {"q": too_many}, "options": {"strict": True}},
                             "too_many_options")]:
        result = client.call("decide", arguments)
        assert result.is_error and result.structured_content["error"]["code"] == code
        assert any(phrase in result.content[0].text for phrase in KIT_PHRASES), result.content[0].text

"""``clef-gguf mcp``: the loaded models as a Model Context Protocol server on stdin/stdout.

A desktop agent (Claude Desktop, an IDE) starts the command as a child process and calls two tools:

- ``decide``: its arguments are one SystemOne request (the wire model of ``pipeline/wire.py`` is the
  input schema); the result's structured content is the response ``clef-gguf decide`` prints for the
  same request and flags, byte for byte, and its text one line per answer (then the JSON, as the
  protocol asks of tools with structured results, for clients that read only text).
- ``models``: what ``GET /v1/models`` lists (``runtime.registry.model_entries``).

A bad request is the tool's error (``is_error``, the error code, message and field as text and as
``{"error": ...}``), never the process's: the agent reads it and corrects its call.

The SDK's low-level server, not its decorator API: the decorator validates arguments against a
model of the function's signature first, and its errors carry no code or field; here the request
parser alone validates, as for every other way in.

stdout is the protocol's channel. The models load once, before the first message is read, with fd 1
pointed at stderr (llama.cpp and a library's stray ``print`` write to the process's fd 1, not to
Python's logging); while serving, the SDK's stdio transport diverts fd 1 itself.

Pictures: an agent writes the requests, and a request could name any file the user can read, so
only inline pictures (data: URIs, base64) are read unless ``--media-allow-files DIR`` opens a
directory (``serve``'s flag and policy, ``media.sources.served_sources``); never URLs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import textwrap
from collections.abc import Iterator, Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any

from clef_gguf import __version__
from clef_gguf.core.deps import need
from clef_gguf.core import errors
from clef_gguf.core.questions import TYPES, question_type, winner
from clef_gguf.media.sources import MediaPolicy, add_file_roots_argument, served_sources
from clef_gguf.runtime.flags import add_model_arguments, load_model
from clef_gguf.runtime.registry import Models, model_entries

if TYPE_CHECKING:
    from mcp.server.context import ServerRequestContext
    from mcp.server.lowlevel import Server
    from mcp.types import CallToolRequestParams, CallToolResult, ListToolsResult, PaginatedRequestParams, Tool

log = logging.getLogger("clef_gguf.agent")

EXTRA = "mcp"  # pip install 'clef-gguf[mcp]'
SDK_MAJOR = 2  # the low-level server's constructor handlers and snake_case fields are 2.x's

DECIDE = ("Answer questions about a state with the Clef decision model (Cloudflare's SystemOne format), "
          "in one forward pass, no text generated. Arguments: `state` (text, or any JSON: a ticket, "
          "a record, a conversation) and `questions` (id -> question). Question types: "
          + "; ".join(f"`{t.name}` = {t.summary}" for t in TYPES) + ". Optional: `instructions` "
          "per question, `images` (data: URIs or base64), `model` (a served model or fine-tune; "
          "see the models tool), `options` ({truncate_state, strict}), `evidence` (true: the state "
          "spans each answer's attention rested on; {\"mode\": \"occlusion\"} also re-runs without each).")
MODELS = "The models this server answers with (a base and its fine-tunes), the default first."
SUMMARY_MAX = 60  # characters of a score level's description in the text summary


# ---------------------------------------------------------------- the tools, without the protocol
class Agent:
    """The two tools over one loaded set of models."""

    def __init__(self, models: Models[Any], media_policy: MediaPolicy) -> None:
        self.models, self.media_policy = models, media_policy

    def decide(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """What ``clef-gguf decide`` answers for the request ``arguments`` (raises its ClefError)."""
        prepared = self.models.prepare(dict(arguments), media_policy=self.media_policy)
        return self.models.run(prepared).response

    def listing(self) -> dict[str, Any]:
        return {"models": model_entries(self.models.models, self.models.default)}


def _level(description: Any) -> str:
    text = description if isinstance(description, str) else json.dumps(description, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= SUMMARY_MAX else text[:SUMMARY_MAX - 1] + "…"


def summary(response: Mapping[str, Any]) -> str:
    """One line per answer (``urgent: noul 0.9731``, ``team: choice billing (0.8112)``, ``anger:
    score 1.2034 (annoyed, 0.5531)``: the expected level, then the likeliest level and its
    probability), then the model, truncation and warnings."""
    lines = []
    for qid, answer in response["answers"].items():
        fields = dict(answer)
        if "legend" in answer:  # the likeliest level's description: the levels' ``winner``
            levels = list(answer["probabilities"].items())
            fields["likeliest"] = _level(answer["legend"][levels[winner([p for _, p in levels])][0]])
        line = question_type(answer.get("type"), field=f"answers.{qid}.type").mcp_line
        lines.append(f"{qid}: {line.format_map(fields)}")
    lines.append(f"model: {response['model']}")
    if response.get("truncated"):
        lines.append("truncated: the state was cut to fit the window")
    lines.extend(f"warning: {w['code']} ({w.get('field')}): {w['message']}" for w in response.get("warnings", ()))
    return "\n".join(lines)


# ---------------------------------------------------------------- the protocol
def tools() -> list[Tool]:
    from mcp.types import Tool, ToolAnnotations

    from clef_gguf.pipeline.wire import SystemOneRequest

    # Reads what a request names and nothing else; the same request, the same answer.
    hints = ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)
    return [
        Tool(name="decide", title="Clef decision", description=DECIDE,
             input_schema=SystemOneRequest.model_json_schema(), annotations=hints),
        Tool(name="models", title="Served models", description=MODELS,
             input_schema={"type": "object", "properties": {}, "additionalProperties": False},
             annotations=hints),
    ]


def _result(structured: dict[str, Any], text: str, *, is_error: bool = False) -> CallToolResult:
    from mcp.types import CallToolResult, TextContent

    blocks = [text, json.dumps(structured, ensure_ascii=False)]
    return CallToolResult(content=[TextContent(type="text", text=t) for t in blocks],
                          structured_content=structured, is_error=is_error)


def build_server(agent: Agent) -> Server[Any]:
    """The MCP server of ``agent``'s tools; one forward pass at a time (one llama.cpp context)."""
    import anyio
    from anyio import to_thread
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError
    from mcp.types import INVALID_PARAMS, ListToolsResult

    listed = tools()
    one_at_a_time = anyio.CapacityLimiter(1)

    async def list_tools(_ctx: ServerRequestContext[Any], _params: PaginatedRequestParams | None
                         ) -> ListToolsResult:
        return ListToolsResult(tools=listed)

    async def call_tool(_ctx: ServerRequestContext[Any], params: CallToolRequestParams) -> CallToolResult:
        if params.name == "models":
            listing = agent.listing()
            names = [f"{m['name']}{' (default)' if m['default'] else ''}" for m in listing["models"]]
            return _result(listing, "\n".join(names))
        if params.name != "decide":  # the protocol's error: no such tool (the agent's mistake, not a request's)
            raise MCPError(code=INVALID_PARAMS, message=f"unknown tool {params.name!r}: decide, models")
        try:
            # In a worker thread: a forward pass takes seconds, and pings must still be answered.
            response = await to_thread.run_sync(agent.decide, params.arguments or {}, limiter=one_at_a_time)
        except errors.ClefError as exc:
            log.info("decide refused: %s", exc)
            return _result(exc.to_dict(), str(exc), is_error=True)
        return _result(response, summary(response))

    return Server("clef-gguf", version=__version__, on_list_tools=list_tools, on_call_tool=call_tool,
                  instructions="Clef decision models: call `decide` with a SystemOne request "
                               "(state + questions) for a probability of every option; `models` "
                               "lists the served models and fine-tunes.")


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """fd 1 (what C code and ``print`` write to) points at stderr inside the block."""
    sys.stdout.flush()
    wire = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()  # what Python buffered inside goes to stderr too, not onto the wire later
        os.dup2(wire, 1)
        os.close(wire)


def require_sdk() -> None:
    """The MCP SDK, 2.x, or a clear error naming the extra that installs it."""
    need("mcp", EXTRA)
    version = metadata.version("mcp")
    if int(version.split(".")[0]) < SDK_MAJOR:
        raise errors.MissingDependency(f"clef-gguf mcp needs the mcp SDK {SDK_MAJOR}.x (found {version}): "
                                       f"pip install 'clef-gguf[{EXTRA}]'")


# ---------------------------------------------------------------- command line
EPILOG = """\
The server speaks MCP on stdin/stdout: an agent starts it, it is not run by hand. Claude Desktop's
claude_desktop_config.json:

  {"mcpServers": {"clef": {"command": "clef-gguf",
                           "args": ["mcp", "--model", "/path/to/model"]}}}

Tools: decide (a SystemOne request: state, questions, images, model, options -> the response of
`clef-gguf decide`) and models (what GET /v1/models lists). The model loads once, at start; logs go
to stderr. Needs pip install 'clef-gguf[mcp]'."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``clef-gguf mcp`` flags: the shared model flags plus where pictures may come from."""
    # Raw, to keep the config snippet's lines; the one-line description is wrapped here instead.
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = textwrap.fill(p.description or "", 100)
    p.epilog = EPILOG
    add_model_arguments(p)
    g = p.add_argument_group("mcp")
    add_file_roots_argument(g, "inline images only (data: URIs, base64); a path is refused "
                               "(unsupported_media_source)")


def run(args: argparse.Namespace) -> int:
    """Load the models, then serve one MCP session on stdin/stdout until the client closes it."""
    import anyio

    require_sdk()  # before a load that can take minutes
    policy = served_sources(args)  # a --media-allow-files that is no directory: refused before it too
    logging.getLogger("clef_gguf.agent").setLevel(logging.INFO)
    with stdout_to_stderr():
        models = load_model(args)
    with models:
        server = build_server(Agent(models, policy))
        log.info("serving %s over MCP on stdin/stdout", ", ".join(models))
        anyio.run(_serve, server)
    return 0


async def _serve(server: Server[Any]) -> None:
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())

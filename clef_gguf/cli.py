"""``clef-gguf``: one sub-command per job. The table below is the whole command surface.

Errors print ``{"error": {"code", "message", "field"}}`` on stdout: exit 2 for a bad request
(invalid, or too long for the window) or bad arguments, 1 for anything else (missing or corrupt
model files, ...).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from clef_gguf import __version__
from clef_gguf.core import errors
from clef_gguf.runtime.flags import add_model_arguments, load_model, read_request

# name -> (module, add-arguments function, run function, one-line help)
COMMANDS = {
    "decide": ("clef_gguf.cli", "add_decide_arguments", "run_decide",
               "answer one SystemOne request (JSON file or stdin) and print the response"),
    "demo": ("clef_gguf.convert.cli", "add_demo_arguments", "run_demo",
             "build a tiny RANDOM-weight Clef release offline and convert it (pipeline demo)"),
    "convert": ("clef_gguf.convert.cli", "add_convert_arguments", "run_convert",
                "convert a Hugging Face Clef release directory to a tower GGUF + head files "
                "(for a native clef-arch GGUF use: clef-gguf convert split FILE OUT)"),
    "convert-split": ("clef_gguf.convert.split", "add_split_arguments", "run_split",
                      "split a native clef-arch GGUF (head inside) into a qwen35 tower GGUF + "
                      "head files, without re-quantizing; also spelled `convert split`"),
    "convert-adapter": ("clef_gguf.convert.cli", "add_adapter_arguments", "run_adapter",
                        "convert a LoRA fine-tune (clef-finetune checkpoint, or PEFT adapter + head) "
                        "into a fine-tune directory for a converted base, for --adapter; also "
                        "spelled `convert adapter`"),
    "imatrix": ("clef_gguf.tools.imatrix_command", "add_arguments", "run",
                "measure an importance matrix on decision records (their real prompts) with an "
                "f32/f16/bf16 model, for convert --imatrix FILE (llama-imatrix's GGUF format)"),
    "batch": ("clef_gguf.bulk.job", "add_arguments", "run",
              "answer every record of a JSONL or Parquet file into an output file (resumable; "
              "local or Ray engine)"),
    "serve": ("clef_gguf.server.app", "add_arguments", "run",
              "serve POST /v1/systemone (SystemOne wire format) on a local HTTP port"),
    "ui": ("clef_gguf.server.ui_command", "add_arguments", "run",
           "open the decision playground in the browser (serve on a free loopback port + GET /)"),
    "mcp": ("clef_gguf.agent.mcp_server", "add_arguments", "run",
            "serve the model to AI agents over the Model Context Protocol on stdin/stdout (tools: "
            "decide, models; for Claude Desktop and other MCP clients; pip install 'clef-gguf[mcp]')"),
    "pull": ("clef_gguf.pick.catalog_commands", "add_pull_arguments", "run_pull",
             "download a catalog model (tower GGUF + head + tokenizer) at its pinned revision"),
    "list": ("clef_gguf.pick.catalog_commands", "add_list_arguments", "run_list",
             "show the models in the local Hugging Face cache (or --available: the catalog)"),
    "pick": ("clef_gguf.pick.command", "add_arguments", "run",
             "probe this machine and recommend the best quant that fits, saying why"),
    "tune": ("clef_gguf.tools.tune_command", "add_arguments", "run",
             "measure how to run a model on this machine (threads, decode chunk, flash attention, pack "
             "size; on a GPU the head's device and dtype), side by side; every command uses the winners"),
    "bench": ("clef_gguf.tools.bench", "add_arguments", "run",
              "time one decision per pipeline stage (encode/tower/lexical/head) on this machine"),
    "bench-server": ("clef_gguf.tools.bench_server", "add_arguments", "run",
                     "requests/s and p50/p95 latency of `serve` at concurrency 1, 8, 32"),
    "quant-table": ("clef_gguf.tools.quant_table", "add_arguments", "run",
                    "agreement of every quant type with the transformers reference (Markdown table)"),
    "parity": ("clef_gguf.tools.parity", "add_arguments", "run",
               "compare a converted model with the transformers reference of its release"),
    "eval": ("clef_gguf.evaluate.cli", "add_eval_arguments", "run_eval",
             "metrics of a model on labelled records (clef-finetune's), or several quants side "
             "by side: agreement, deltas with intervals, cost, report.md"),
    "calibrate": ("clef_gguf.evaluate.calibrate", "add_calibrate_arguments", "run_calibrate",
                  "fit temperatures per question type and option band (labels, or --reference "
                  "for label-free) and write CAL.json for --calibration"),
}


def add_decide_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--request", "-r", default="-",
                   help="request JSON file, or - for stdin (default)")
    p.add_argument("--truncate-state", action="store_true",
                   help="cut an over-long state to fit the window (the response then carries "
                        '"truncated": true) instead of refusing the request')
    p.add_argument("--timings", action="store_true",
                   help="print the time per stage (encode/tower/lexical/head, ms) on stderr")
    p.add_argument("--evidence", nargs="?", const="attention", choices=("attention", "occlusion"),
                   help='add the state spans each answer\'s attention rested on ("evidence": true); '
                        "=occlusion also re-runs the decision without each span (docs/evidence.md)")
    p.add_argument("--format", choices=("json", "text"), default="json",
                   help="json (default): the response as sent over HTTP; text: answers and evidence "
                        "as lines for people")


def run_decide(args: argparse.Namespace) -> int:
    request = read_request(args.request)
    if args.evidence is not None and isinstance(request, dict):  # the request's own top/options kept
        own = request.get("evidence")
        request = {**request, "evidence": {**(own if isinstance(own, dict) else {}), "mode": args.evidence}}
    with load_model(args) as clef:
        prepared = clef.prepare(request, truncate_state=args.truncate_state)
        response, timings = clef.run(prepared)
    if args.format == "text":
        from clef_gguf.pipeline.answer_text import as_text

        print(as_text(response))
    else:
        print(json.dumps(response, ensure_ascii=False, indent=2))
    if args.timings:
        print(json.dumps({"timings_ms": timings}), file=sys.stderr)
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (the others cost torch-sized imports)."""
    parser = argparse.ArgumentParser(
        prog="clef-gguf", description="Clef decision models on a GGUF tower + PyTorch joint head.")
    parser.add_argument("--version", action="version", version=f"clef-gguf {__version__}")
    parser.add_argument("--verbose", "-v", action="store_true", help="log llama.cpp and load details")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, add, run, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            mod = importlib.import_module(module)
            getattr(mod, add)(p)
            p.set_defaults(_run=getattr(mod, run))
    return parser


def _fail(error: errors.ClefError) -> int:
    print(json.dumps(error.to_dict(), ensure_ascii=False))
    print(f"clef-gguf: {error}", file=sys.stderr)
    return error.exit_code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Two-word spellings (upstream's `convert split`, and ours for adapters); argparse needs one word.
    if argv[:2] in (["convert", "split"], ["convert", "adapter"]):
        argv[:2] = [f"convert-{argv[1]}"]
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("clef_gguf.tower.llama").setLevel(logging.ERROR)
    try:
        return int(args._run(args) or 0)
    except errors.ClefError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `clef-gguf ... | head` closed stdout: nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bug, not a user error: say so without a wall of traceback
        if args.debug:
            raise
        return _fail(errors.ClefError(f"internal error: {type(exc).__name__}: {exc} "
                                      "(run with --debug for the traceback)"))


if __name__ == "__main__":
    sys.exit(main())

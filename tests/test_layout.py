"""The house layout as rules: no import cycles (function-level imports included), and the model
files (``clef_gguf.models``) stay below the pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> package name in site-packages (pyproject's package-dir)
PACKAGES = {"clef_gguf": "clef_gguf", "heads": "clef_gguf.heads", "convert": "clef_gguf.convert",
            "models": "clef_gguf.models"}
PIPELINE = ["request", "encode", "tower", "towers", "llama", "packing", "statecache", "engine", "lexical", "answer",
            "runtime", "backends", "errors", "files", "limits",
            "nvfp4.checkpoint", "nvfp4.lexical", "nvfp4.model", "nvfp4.tower", "nvfp4.kernels", "nvfp4.format"]


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Project modules ``name`` imports anywhere in its file; ``from pkg import mod`` -> ``pkg.mod``."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    out.add(base)
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(GRAPH):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_the_known_edges():
    # The checker itself must see function-level and `from pkg import mod` imports.
    assert "clef_gguf.models.hub" in GRAPH["clef_gguf.runtime"]  # a function-level import
    assert "clef_gguf.server.schema" in GRAPH["clef_gguf.server.app"]  # from clef_gguf.server import schema
    assert "clef_gguf.cli_options" in GRAPH["clef_gguf.tools.bench"]


def test_no_import_cycles():
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_models_use_only_errors_files_and_argtypes_of_the_runtime():
    allowed = {"clef_gguf.errors", "clef_gguf.files", "clef_gguf.argtypes", "clef_gguf.limits"}
    # pull splits a native clef-arch GGUF on download (a function-level import, only then)
    extra = {"clef_gguf.models.native": {"clef_gguf.convert.split"}}
    for name, deps in GRAPH.items():
        if name.startswith("clef_gguf.models"):
            bad = {d for d in deps if not d.startswith("clef_gguf.models")
                   and d not in allowed | extra.get(name, set())}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_pipeline_imports_models_only_to_resolve_a_name_or_place_the_tower():
    for stage in PIPELINE:
        deps = {d for d in GRAPH[f"clef_gguf.{stage}"] if d.startswith("clef_gguf.models")}
        expected = {"runtime": {"clef_gguf.models.catalog", "clef_gguf.models.hub"},  # resolve a name
                    "backends": {"clef_gguf.models.catalog", "clef_gguf.models.machine",
                                 "clef_gguf.models.placement"},  # place it
                    # the memory left for packed sequences
                    "tower": {"clef_gguf.models.machine", "clef_gguf.models.placement"},
                    "packing": {"clef_gguf.models.machine", "clef_gguf.models.placement"},
                    }.get(stage, set())
        assert deps <= expected, f"clef_gguf.{stage} imports {sorted(deps)}"


def test_the_gguf_path_does_not_import_the_nvfp4_backend_at_module_level():
    # torch-only users of GGUF towers never need transformers or compressed-tensors
    for stage in ("runtime", "backends", "tower", "lexical"):
        tree = ast.parse(MODULES[f"clef_gguf.{stage}"].read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names} \
            | {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if "nvfp4" in n or n.startswith(("transformers", "compressed"))}, stage


def test_pipeline_server_and_tools_do_not_import_the_cli():
    for name, deps in GRAPH.items():
        if name != "clef_gguf.cli":
            assert "clef_gguf.cli" not in deps, f"{name} imports clef_gguf.cli"

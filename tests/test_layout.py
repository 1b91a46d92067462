"""The house layout as rules: packages by layer, the dependencies each may have written as one table
(function-level imports included), no import cycle between packages or modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> package name in site-packages (pyproject's package-dir)
PACKAGES = {"clef_gguf": "clef_gguf", "heads": "clef_gguf.heads", "convert": "clef_gguf.convert",
            "models": "clef_gguf.models"}

# The layers, lowest first, and what each package may import (besides itself). A unit is a package
# of clef_gguf, or a module at its root (``cli``; ``clef_gguf`` is the root package: the public API).
# Read it as docs/architecture.md's picture: nothing imports a row below it.
LOWER = {
    "core": set(),  # errors, limits, question types, CPUs, argparse types, the optional-dependency check
    "formats": {"core"},  # the files: model directory, fine-tune, calibration, GGUF, safetensors
    "heads": {"core", "formats"},  # the PyTorch joint schema head
    "vision": {"core", "formats"},  # the PyTorch vision tower
    "pipeline": {"core", "formats"},  # request, encode, mediaprompt, lexical rows, answer
    "media": {"core", "formats", "vision", "pipeline"},  # pictures and videos into prompt tokens
    "tower": {"core", "formats", "pipeline"},  # hidden states: llama.cpp, nvfp4, the caches
    "convert": {"core", "formats", "heads", "vision", "pipeline", "media", "tower"},  # writing releases
    # the catalog: names, files, pull, placement, the hub. ``convert`` only where a pulled model is made
    # runnable on first use (a native clef GGUF split, ``models/native.py``; an NVFP4 checkpoint
    # re-encoded, ``models/nvfp4_materialize.py``), inside those functions: each is a whole conversion (tower
    # writer, head, tokenizer), not a reader to move below both (MODELS_CONVERT_EDGES below).
    "models": {"core", "formats", "convert"},
    "runtime": {"core", "formats", "heads", "vision", "pipeline", "media", "tower", "models"},
    "clef_gguf": {"core", "runtime"},
}
_BELOW_APPS = set(LOWER)
LOWER |= {  # the applications, on top
    "bulk": _BELOW_APPS,
    "server": _BELOW_APPS,
    "evaluate": _BELOW_APPS | {"bulk"},  # bulk: eval's journal of answers (bulk.output) and batch's media flags
    "agent": _BELOW_APPS,  # clef-gguf mcp
    "pick": _BELOW_APPS,  # pick (the speed probe, the quality judged from an eval's summary), pull, list
    "tools": _BELOW_APPS | {"bulk", "server", "evaluate"},
    "cli": _BELOW_APPS | {"bulk", "server", "evaluate", "agent", "pick", "tools"},
}
# The models -> convert edges, each made inside a function (loading a model never imports the
# converter unless it has to convert): module -> the convert modules it may reach.
MODELS_CONVERT_EDGES = {"clef_gguf.models.native": {"clef_gguf.convert.split"},
                        "clef_gguf.models.nvfp4_materialize": {"clef_gguf.convert.nvfp4_to_gguf"}}


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


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Project modules ``name`` imports anywhere in its file; ``from pkg import mod`` -> ``pkg.mod``.
    A string that is exactly a module's dotted name counts as importing it (the CLI's command table,
    ``importlib.import_module``, a child process's ``-m``), docstrings aside."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in MODULES:  # "clef_gguf" alone is a logger's name, not an import
            if id(node) not in docs:
                out.add(node.value)
        elif isinstance(node, ast.Import):
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


def unit(module: str) -> str:
    """The package (or root module) a module belongs to: clef_gguf.tower.nvfp4.tower -> tower."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        out.setdefault(unit(name), set()).update(unit(d) for d in deps if unit(d) != unit(name))
    return out


def test_the_graph_sees_the_known_edges():
    # The checker itself must see function-level and `from pkg import mod` imports, and the CLI's
    # command table (module names as strings, imported by importlib).
    assert "clef_gguf.models.hub" in GRAPH["clef_gguf.runtime.load"]  # a function-level import
    assert "clef_gguf.server.schema" in GRAPH["clef_gguf.server.app"]  # from clef_gguf.server import schema
    assert "clef_gguf.runtime.flags" in GRAPH["clef_gguf.tools.bench"]
    assert {"clef_gguf.pick.command", "clef_gguf.server.app"} <= GRAPH["clef_gguf.cli"]


def test_the_cli_command_table_is_checked_like_imports():
    from clef_gguf.cli import COMMANDS

    assert {module for module, *_ in COMMANDS.values()} - {"clef_gguf.cli"} <= GRAPH["clef_gguf.cli"]


def test_models_reaches_the_converter_only_inside_the_functions_that_convert():
    for name, deps in GRAPH.items():
        if unit(name) == "models":
            reached = {d for d in deps if unit(d) == "convert"}
            assert reached <= MODELS_CONVERT_EDGES.get(name, set()), (name, sorted(reached))
    for name in MODELS_CONVERT_EDGES:  # never at import time: loading a model does not load torch + gguf writers
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        top = {n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)}
        top |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in top if m.startswith("clef_gguf.convert")}, name


def test_loading_a_model_does_not_import_the_pick_application():
    # runtime -> models is the catalog and placement, never the speed probe
    for name, deps in GRAPH.items():
        if unit(name) in _BELOW_APPS:
            assert not {d for d in deps if unit(d) == "pick"}, name


def test_every_unit_is_in_the_table():
    assert set(unit_graph()) <= set(LOWER), sorted(set(unit_graph()) - set(LOWER))


def test_the_table_is_layered():
    # The table itself has no cycle: each row names only rows above it in the table.
    seen: set[str] = set()
    for name, allowed in LOWER.items():
        assert allowed <= seen, f"{name} may import {sorted(allowed - seen)}, which come later"
        seen.add(name)


def test_packages_import_only_what_the_table_allows():
    bad = {}
    for name, deps in GRAPH.items():
        wrong = sorted(d for d in deps if unit(d) != unit(name) and unit(d) not in LOWER[unit(name)])
        if wrong:
            bad[name] = wrong
    assert not bad, bad


def test_no_package_level_cycles():
    graph = unit_graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
            if nxt not in state and (found := visit(nxt, stack + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            assert (found := visit(node, [node])) is None, " -> ".join(found)


def test_no_import_cycles():
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_the_gguf_path_does_not_import_the_nvfp4_backend_at_module_level():
    # torch-only users of GGUF towers never need transformers or compressed-tensors
    for module in ("runtime.model", "runtime.backends", "tower.llama_tower", "pipeline.lexical"):
        tree = ast.parse(MODULES[f"clef_gguf.{module}"].read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names} \
            | {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if "nvfp4" in n or n.startswith(("transformers", "compressed"))}, module


def test_nothing_imports_the_cli():
    for name, deps in GRAPH.items():
        if name != "clef_gguf.cli":
            assert "clef_gguf.cli" not in deps, f"{name} imports clef_gguf.cli"


def test_the_root_holds_only_the_api_and_the_command_line():
    assert sorted(p.name for p in (ROOT / "clef_gguf").glob("*.py")) == ["__init__.py", "cli.py"]


def _named_in_architecture_page() -> set[str]:
    """The modules docs/architecture.md names, as source paths without ``clef_gguf/``: a path in backticks
    (``tower/llama.py``), a bare file name under the last package folder named before it (``- `media/`: ...
    `sources.py```), or a dotted name (``clef_gguf.runtime.settings.LoadSettings``)."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    by_dotted = {name: path.relative_to(ROOT).as_posix() for name, path in MODULES.items()}
    named, folder = set(), None
    for raw in re.findall(r"`([^`\s]+)`", doc):
        token = raw.removeprefix("clef_gguf/")
        if token.endswith("/"):
            if (ROOT / token / "__init__.py").is_file() or (ROOT / "clef_gguf" / token / "__init__.py").is_file():
                folder = token.rstrip("/")  # a package folder, not `static/` or `docs/`
        elif token.endswith(".py"):
            named.add(token if "/" in raw or folder is None else f"{folder}/{token}")
        else:
            parts = token.split(".")
            for n in range(len(parts), 1, -1):
                if (found := by_dotted.get(".".join(parts[:n]))) is not None:
                    named.add(found.removeprefix("clef_gguf/"))
                    break
    return named


def test_the_architecture_page_names_every_module():
    named = _named_in_architecture_page()
    missing = sorted(rel for path in MODULES.values() if path.name not in ("__init__.py", "__main__.py")
                     and (rel := path.relative_to(ROOT).as_posix().removeprefix("clef_gguf/")) not in named)
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_a_module_over_400_lines_says_why_in_its_docstring():
    unexplained = [name for name, path in MODULES.items()
                   if len(text := path.read_text(encoding="utf-8").splitlines()) > 400
                   and "400 lines" not in (ast.get_docstring(ast.parse("\n".join(text))) or "")]
    assert not unexplained, f"{unexplained}: split the module, or give its docstring a one-line reason"


# ---------------------------------------------------------------- one registry per concept
# The optional-dependency check is core/deps.py's ``need``, below every application.


def test_no_module_imports_bulk_for_a_dependency_check():
    assert "clef_gguf.bulk.deps" not in MODULES, "the dependency check's home is clef_gguf.core.deps"
    defined = {name for name, path in MODULES.items()
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.FunctionDef) and node.name == "need" and node.col_offset == 0}
    assert defined == {"clef_gguf.core.deps"}, sorted(defined)


# Byte sizes are written with core/limits' units (KiB, MiB, GiB, GB), never as 32 * 1024 * 1024, 2**20,
# 1 << 20 or 10**9. What such an expression means where it is not a byte size, by file and value:
NOT_BYTES = {("heads/load.py", 1 << 20): "MAX_SIZE bounds a head's dimensions, a count"}
# Byte sizes still written out in files other changes hold now: (file, value) -> the unit to use.
_UNIT_EXPONENTS = {10, 20, 30, 40}


def _byte_literal(node: ast.AST) -> int | None:
    """The value of ``node`` when it spells a byte unit out (``x << 20``, ``2 ** 30``, ``x * 1024``,
    ``1024 ** 2``, ``10 ** 9``), else None."""
    if not isinstance(node, ast.BinOp):
        return None
    left, right = (n.value if isinstance(n, ast.Constant) and type(n.value) is int else None
                   for n in (node.left, node.right))
    spelled = (isinstance(node.op, ast.LShift) and right in _UNIT_EXPONENTS
               or isinstance(node.op, ast.Pow) and ((left == 2 and right in _UNIT_EXPONENTS) or left == 1024
                                                    or (left == 10 and right in (6, 9, 12)))
               or isinstance(node.op, ast.Mult) and 1024 in (left, right))
    if not spelled:
        return None
    try:
        return int(eval(compile(ast.Expression(node), "<literal>", "eval"), {}))  # constants only, else -1
    except Exception:
        return -1


def _byte_literals(tree: ast.AST) -> list[tuple[ast.BinOp, int]]:
    """Every outermost expression of ``tree`` that spells a byte unit out, with its value (-1: not
    constant): ``32 * 1024 * 1024`` once, not also its ``32 * 1024``."""
    out: list[tuple[ast.BinOp, int]] = []

    def visit(node: ast.AST) -> None:
        value = _byte_literal(node)
        if value is not None:
            assert isinstance(node, ast.BinOp)
            out.append((node, value))
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def test_byte_sizes_are_written_with_the_limits_units():
    found = []
    for path in MODULES.values():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "clef_gguf/core/limits.py":
            continue
        for node, value in _byte_literals(ast.parse(path.read_text(encoding="utf-8"))):
            if (rel, value) not in NOT_BYTES:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, f"write these with clef_gguf.core.limits' KiB/MiB/GiB/GB: {found}"


def test_the_byte_scan_sees_every_spelling():
    for text in ("32 * 1024 * 1024", "2 ** 20", "1 << 30", "n << 20", "1024 ** 2", "5 * 10 ** 9", "x * 1024"):
        assert len(_byte_literals(ast.parse(text))) == 1, text
    for text in ("1 << 16", "2 ** 63", "n * 1000", "x ** 2", "64 * MiB"):
        assert not _byte_literals(ast.parse(text)), text


# ``*_FORMAT`` names a version tag clef-gguf writes into a file of its own (``"format": "clef-gguf-eval/1"``)
# and nothing else: compressed-tensors' format of an NVFP4 checkpoint is ``COMPRESSION``, Pillow's image
# types ``DECODED_IMAGE_TYPES``. The values never change for a rename: files on users' disks still read.
FILE_FORMAT = re.compile(r"clef-gguf[\w-]*/\d+")


def test_format_constants_have_one_meaning():
    wrong = []
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name) and "FORMAT" in target.id:
                    value = getattr(node, "value", None)
                    tag = value.value if isinstance(value, ast.Constant) else None
                    if not (target.id.endswith("_FORMAT") and isinstance(tag, str) and FILE_FORMAT.fullmatch(tag)):
                        wrong.append(f"{name}.{target.id}")
    assert not wrong, f"a *_FORMAT constant is a clef-gguf file's version tag, and only that: {wrong}"

"""A missing optional dependency is reported one way (``core/deps.py``): ``missing_dependency``, with the
pip extra that installs it, wherever the code imports one."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

from clef_gguf.core import deps, errors

ROOT = Path(__file__).resolve().parents[2]
# The packages only an extra installs (as imported), each checked with need() where it is used.
OPTIONAL = {"ray", "pyarrow", "mcp", "transformers", "compressed_tensors", "fla", "matplotlib", "causal_conv1d",
            "peft", "schemathesis", "pandas"}


def test_the_extras_are_pyproject_s():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(deps.EXTRAS) == set(extras) - {"test"}


def test_need_imports_the_module():
    assert deps.need("json", "eval") is sys.modules["json"]


def test_a_missing_module_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # None: importing it fails
    with pytest.raises(errors.MissingDependency) as info:
        deps.need("pyarrow", "parquet")
    assert info.value.code == "missing_dependency" and info.value.field is None
    assert info.value.message == "pyarrow is not installed: pip install 'clef-gguf[parquet]'"
    with pytest.raises(errors.MissingDependency) as info:
        deps.need("pyarrow", "ray", what="the Ray engine needs pyarrow", field="engine")
    assert (info.value.message, info.value.field) == ("the Ray engine needs pyarrow: pip install 'clef-gguf[ray]'",
                                                      "engine")


def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8"))
            for folder in ("clef_gguf", "heads", "convert", "models") for path in (ROOT / folder).rglob("*.py")}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}


def _dotted(path: Path) -> str:
    """The module's import name: heads/, convert/ and models/ install under clef_gguf."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "clef_gguf" else ["clef_gguf", *parts])


def _imported(tree: ast.Module) -> set[str]:
    """Module names ``tree`` imports: import statements (``from pkg import mod`` as ``pkg.mod`` too), and
    strings naming one (``"pkg.mod"``, ``"pkg.mod:attr"``: Ray's and the CLI's import paths)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("clef_gguf."):
            out.add(node.value.split(":")[0])
    return out


def test_a_module_that_imports_an_optional_package_checks_it_with_need():
    # in itself, or in every module that imports it (one imported only after its importer's check)
    trees = {_dotted(path): tree for path, tree in _modules().items()}
    checks = {name for name, tree in trees.items()
              if {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)} & {"need", "deps.need"}}
    imports = {name: _imported(tree) for name, tree in trees.items()}
    unchecked = []
    for name, tree in trees.items():
        hidden = _type_checking_only(tree)
        optional = {module.split(".")[0] for node in ast.walk(tree) if id(node) not in hidden
                    and isinstance(node, (ast.Import, ast.ImportFrom))
                    for module in _imported(ast.Module(body=[node], type_ignores=[]))} & OPTIONAL
        importers = {other for other, names in imports.items() if name in names and other != name}
        if optional and name not in checks and not (importers and importers <= checks):
            unchecked.append(f"{name}: {sorted(optional)}")
    assert not unchecked, f"import these through clef_gguf.core.deps.need: {unchecked}"


def test_every_extra_named_in_the_code_is_one_pyproject_has():
    # the extra is need()'s and missing()'s second argument, install_hint()'s first: a string, or a
    # module constant holding one
    position = {"need": 1, "missing": 1, "install_hint": 0}
    named = []
    for path, tree in _modules().items():
        if path == ROOT / "clef_gguf" / "core" / "deps.py":
            continue
        constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            at = position.get(ast.unparse(node.func).split(".")[-1]) if isinstance(node, ast.Call) else None
            if at is not None and len(node.args) > at:
                arg = node.args[at]
                value = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", ""))
                named.append((f"{path.relative_to(ROOT)}:{node.lineno}", value))
    assert len(named) > 10
    assert not [(where, extra) for where, extra in named if extra not in deps.EXTRAS]


def test_nothing_else_turns_an_import_error_into_a_clef_error():
    # ``except ImportError`` that raises: the one place is core/deps.py (gguf.py's skips an unknown type)
    raising = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None \
                    and "ImportError" in ast.unparse(node.type) \
                    and any(isinstance(n, ast.Raise) for n in ast.walk(node)):
                raising.append(str(path.relative_to(ROOT)))
    assert raising == ["clef_gguf/core/deps.py"], raising

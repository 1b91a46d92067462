"""Run mypy (settings: pyproject.toml [tool.mypy]) over the modules as they are installed.

pyproject's ``package-dir`` installs ``heads/`` as ``clef_gguf.heads`` (and ``convert/``, ``models/``
likewise). mypy cannot follow setuptools' editable-install finder, so this links that layout into
``build/mypy-layout`` (named in ``mypy_path``) and then runs mypy with the given arguments:

    python scripts/typecheck.py            # the whole package
    python scripts/typecheck.py --no-incremental
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "build" / "mypy-layout"


def link_layout() -> None:
    """One link per package installed from another folder than its dotted name says."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        if Path(*package.split(".")) == Path(folder):
            continue  # found where it is
        link = LAYOUT.joinpath(*package.split("."))
        target = os.path.relpath(ROOT / folder, link.parent)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(target, target_is_directory=True)


def main(argv: list[str]) -> int:
    link_layout()
    return subprocess.call([sys.executable, "-m", "mypy", *argv], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

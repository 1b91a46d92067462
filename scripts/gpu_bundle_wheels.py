"""The wheels ``scripts/gpu-bundle.sh`` downloads: every ``[project].dependencies`` entry and the ``nvfp4``
extra of pyproject.toml, with everything they need, each at the version ``requirements/test.txt`` pins.

The bundle installs with ``--no-deps`` on a host that reaches no index, so the whole closure is listed:
requirements/test.txt's ``# via`` lines say which pinned package needs which. Left out: ``HOST`` (what a
GPU image with torch has; torch's own dependencies are reached through torch only) and llama-cpp-python
(gpu-bundle.sh builds it for CUDA; its dependencies are listed).

    python scripts/gpu_bundle_wheels.py              # NAME==VERSION, one a line
    python scripts/gpu_bundle_wheels.py --pin NAME   # NAME's pin alone
A package with no pin is an error naming it (exit 1).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("nvfp4",)
CHECK_NEEDS = ("httpx",)  # bench-server's client (the check's throughput row), from the test extra
HOST = {"torch", "numpy"}  # the GPU image's own (a bundled numpy would shadow the one its torch was built with)
BUILT = {"llama-cpp-python"}  # compiled by gpu-bundle.sh, not downloaded
# The nvfp4 backend's Triton kernels on a GPU (the fla extra, pure Python), at the versions checked there.
EXTRA_PINS = ("fla-core==0.6.0", "einops==0.8.1")


def normal(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return normal(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def roots(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The names of the project's dependencies and of its ``EXTRAS`` in pyproject's order, then ``CHECK_NEEDS``."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    specs = list(project["dependencies"]) + [s for e in EXTRAS for s in project["optional-dependencies"][e]]
    return list(dict.fromkeys([*(_name(s) for s in specs), *CHECK_NEEDS]))


def pins(requirements: Path = ROOT / "requirements" / "test.txt") -> dict[str, tuple[str, set[str]]]:
    """Each pinned package: its version and the packages its ``# via`` lines name."""
    out: dict[str, tuple[str, set[str]]] = {}
    current = None
    for line in requirements.read_text(encoding="utf-8").splitlines():
        pinned = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)", line)
        if pinned:
            current = normal(pinned.group(1))
            out[current] = (pinned.group(3), set())
            continue
        via = re.match(r"\s*#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._-]*)\s*$", line)
        if current and via and via.group(1) != "via":
            out[current][1].add(normal(via.group(1)))
    return out


def closure(names: list[str], pinned: dict[str, tuple[str, set[str]]]) -> list[str]:
    """``names`` and every pinned package one of them needs, transitively, never through ``HOST``."""
    missing = [n for n in names if n not in pinned]
    if missing:
        raise KeyError(missing[0])
    needed = [n for n in names if n not in HOST]
    grew = True
    while grew:
        grew = False
        for name, (_, via) in pinned.items():
            if name not in needed and name not in HOST and via & set(needed):
                needed.append(name)
                grew = True
    return needed


def wheels() -> list[str]:
    """``NAME==VERSION`` of every wheel the bundle downloads."""
    pinned = pins()
    return [f"{n}=={pinned[n][0]}" for n in closure(roots(), pinned) if n not in BUILT] + list(EXTRA_PINS)


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["--pin"] and len(argv) == 2:
            name = normal(argv[1])
            print(f"{name}=={pins()[name][0]}")
        elif not argv:
            print("\n".join(wheels()))
        else:
            print(__doc__.strip().splitlines()[-3], file=sys.stderr)
            return 2
    except KeyError as exc:
        print(f"gpu-bundle: {exc.args[0]} is not pinned in requirements/test.txt", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

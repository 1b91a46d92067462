"""The README's promise: its test command is the one CI runs, and its install command exists."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci_test_command() -> str:
    found = re.search(r"^TEST_COMMAND='(.+)'$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    assert found, ".ci/run must define TEST_COMMAND='...'"
    return found.group(1)


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.DOTALL)


def test_ci_runs_the_readme_test_command_word_for_word():
    command = _ci_test_command()
    assert command in [block.strip() for block in _readme_commands()]
    # a venv of its own and the committed pins, so nothing already installed can satisfy a requirement
    assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert "-c requirements/test.txt" in command and command.endswith("python -m pytest")


def test_the_pins_cover_every_test_requirement():
    pins = {}
    for line in (ROOT / "requirements" / "test.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name.split("[")[0].lower())] = version.split(";")[0].strip()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
        name = re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~; ]", requirement)[0].lower())
        assert pins.get(name), f"{name} is not pinned in requirements/test.txt"

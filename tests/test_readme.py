"""The README's promise: its test command is the one CI runs, and its install command exists."""

import argparse
import re
import shlex
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


# ---------------------------------------------------------------- the docs hold the same promise
# README.md and docs/*.md: their links resolve, their commands and flags exist, the README stays
# a front door. Each check names the page and the line, so a failure says what to fix in the docs.

README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Paths in code that name a file of this repository, checked to exist (`clef_gguf/tower/cache.py`).
REPO_PATH = re.compile(r"^(?:clef_gguf|heads|convert|models|scripts|tests|benchmarks|requirements|docs)/"
                       r"[\w./-]*$")
TWO_WORD = {"split", "adapter"}  # `clef-gguf convert split` is the sub-command convert-split


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans removed."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"(`+).*?\1", "", line)))
    return out


def _fences(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced code block."""
    return [(m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE)]


def _code_spans(text: str) -> list[tuple[int, str]]:
    """(line number, content) of every inline code span outside fenced blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.extend((number, m.group(2)) for m in re.finditer(r"(`+)(.+?)\1", line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _headings(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        found = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if found:
            slug = _slug(found.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(f"{slug}-{n}" if n else slug)
    return out


def _links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside code."""
    return [(number, m.group(1)) for number, line in _prose(path.read_text(encoding="utf-8"))
            for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)]


def _broken_links(page: Path) -> list[str]:
    bad = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        where = (page.parent / file_part).resolve() if file_part else page
        if not where.exists():
            bad.append(f"{_rel(page)}:{number}: {target} -> no such file")
        elif anchor and where.suffix == ".md" and anchor not in _headings(where):
            bad.append(f"{_rel(page)}:{number}: {target} -> no heading #{anchor} in {_rel(where)}")
    return bad


def _shell_commands(body: str) -> list[list[str]]:
    """The simple commands of a bash block, as token lists (a quoted string stays one token)."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        try:
            for token in iter(lexer.get_token, lexer.eof):
                if set(token) <= set(";&|()<>"):  # a separator, a pipe or a redirection
                    commands.append(current)
                    current = []
                else:
                    current.append(token)
        except ValueError as exc:  # an unbalanced quote: the block would not run either
            raise AssertionError(f"a bash line does not parse: {exc}\n{line}") from exc
        commands.append(current)
    return [c for c in commands if c]


def _clef_invocations(page: Path) -> list[tuple[str, list[str]]]:
    """(where, [command, words...]) of every `clef-gguf ...` a page shows: in a bash block, or an
    inline code span that starts with it (the synopses)."""
    text = page.read_text(encoding="utf-8")
    found = []
    for language, first, body in _fences(text):
        if language != "bash":
            continue
        for words in _shell_commands(body):
            while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # FOO=1 clef-gguf ...
                words = words[1:]
            if words and words[0] == "clef-gguf":
                found.append((f"{_rel(page)}: bash block at line {first}", words[1:]))
    for number, span in _code_spans(text):
        if span.startswith("clef-gguf "):
            # synopsis notation ([--flag X], a|b, \| in tables) is not shell: split on spaces
            found.append((f"{_rel(page)}:{number}", span.replace("\\|", "|").split()[1:]))
    return found


def _subcommand(words: list[str]) -> tuple[str | None, list[str]]:
    """The sub-command of `clef-gguf WORDS` (global flags skipped; `convert split` as one) and the rest."""
    rest = list(words)
    while rest and rest[0] in ("--verbose", "-v", "--debug"):
        rest.pop(0)
    if not rest or rest[0] in ("--help", "-h", "--version"):
        return None, rest
    if rest[0] == "convert" and len(rest) > 1 and rest[1] in TWO_WORD:
        return f"convert-{rest[1]}", rest[2:]
    return rest[0], rest[1:]


def _options(command: str) -> set[str]:
    from clef_gguf import cli

    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices[command]._actions for s in a.option_strings} | {
        s for a in parser._actions for s in a.option_strings}


def _flags(words: list[str]) -> list[str]:
    """The option tokens of a command line: `--name` / `--name=value` / `-x`, not values or JSON."""
    out = []
    for word in words:
        found = re.match(r"^\[*(--?[A-Za-z][\w-]*)(?:=.*)?\]*$", word)
        if found and not word.startswith("-" * 3):
            out.append(found.group(1))
    return out


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference material into docs/")


def test_the_readme_links_every_docs_page():
    readme = {(ROOT / target.partition("#")[0]).resolve() for _, target in _links(ROOT / "README.md")}
    missing = [_rel(p) for p in PAGES[1:] if p.resolve() not in readme]
    assert not missing, f"README.md does not link {missing}"


def test_every_relative_link_resolves():
    bad = [b for page in PAGES for b in _broken_links(page)]
    assert not bad, "\n".join(bad)


def test_every_repository_path_in_code_exists():
    bad = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        words = [(f"{_rel(page)}:{n}", w) for n, span in _code_spans(text) for w in span.split()]
        words += [(f"{_rel(page)}: bash block at line {first}", w)
                  for lang, first, body in _fences(text) if lang == "bash" for w in body.split()]
        for where, word in words:
            word = word.strip("'\"(),;:")
            if REPO_PATH.match(word) and not (ROOT / word).exists():
                bad.append(f"{where}: {word} does not exist")
    assert not bad, "\n".join(bad)


def test_every_clef_gguf_command_shown_exists():
    from clef_gguf import cli

    bad, seen = [], 0
    for page in PAGES:
        for where, words in _clef_invocations(page):
            command, _ = _subcommand(words)
            seen += 1
            if command is not None and command not in cli.COMMANDS:
                bad.append(f"{where}: `clef-gguf {' '.join(words[:2])}` is no sub-command "
                           f"(there are {', '.join(sorted(cli.COMMANDS))})")
    assert seen > 50, f"only {seen} clef-gguf commands found in the docs: is the parser blind?"
    assert not bad, "\n".join(bad)


def test_every_flag_shown_is_one_its_command_takes():
    from clef_gguf import cli

    options: dict[str, set[str]] = {}
    bad = []
    for page in PAGES:
        for where, words in _clef_invocations(page):
            command, rest = _subcommand(words)
            if command not in cli.COMMANDS:
                continue  # test_every_clef_gguf_command_shown_exists says so
            if command not in options:
                options[command] = _options(command)
            for flag in _flags(rest):
                if flag not in options[command]:
                    bad.append(f"{where}: `clef-gguf {command}` has no flag {flag}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_what_they_check(tmp_path):
    # The helpers themselves: a broken link, a bogus command and a bogus flag are caught.
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[gone](missing.md) [here](#a-page) [nowhere](#nope)\n\n"
                    "```bash\nFOO=1 clef-gguf decide --model ./m --bogus-flag \\\n  --request '{\"--x\": 1}'"
                    " | jq .\nclef-gguf convert split in.gguf out --tokenizer t.json\n```\n\n"
                    "`clef-gguf nonsense --x`\n", encoding="utf-8")
    assert [b.split(": ", 1)[1] for b in _broken_links(page)] == [
        "missing.md -> no such file", f"#nope -> no heading #nope in {page.name}"]
    found = [(where.split(":")[0], words) for where, words in _clef_invocations(page)]
    assert [_subcommand(w)[0] for _, w in found] == ["decide", "convert-split", "nonsense"]
    assert _flags(_subcommand(found[0][1])[1]) == ["--model", "--bogus-flag", "--request"]
    assert "--bogus-flag" not in _options("decide") and "--request" in _options("decide")
    assert _slug("Which model answers: `model`") == "which-model-answers-model"


def _layout_table() -> dict[str, set[str]]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_layout_for_docs", ROOT / "tests" / "test_layout.py")
    assert spec and spec.loader
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    return layout.LOWER


def test_the_architecture_page_copies_the_layer_table():
    # docs/architecture.md's "Layers" table is tests/test_layout.py's LOWER, row for row, lowest first.
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1]
    lower = _layout_table()
    assert list(rows) == list(lower), "the rows (lowest first) differ from LOWER's"
    below_apps = set(list(lower)[:list(lower).index("clef_gguf") + 1])
    for name, cell in rows.items():
        names = {w.strip() for w in cell.split(",")} - {"nothing", ""}
        shown = (below_apps if "below the apps" in names else set()) | (names - {"below the apps"})
        assert shown == lower[name], f"{name}: the page says {sorted(shown)}, LOWER {sorted(lower[name])}"


def test_the_readme_decision_and_python_api_run_as_pasted(tmp_path):
    """The first command after its install steps (this suite runs installed), then the Python API
    block, in a new folder: the demo model is built, decides, and the Python lines run."""
    import json
    import os
    import subprocess
    import sys

    first = _readme_commands()[0].strip()
    install, sep, decide = first.partition("pip install . && ")
    assert sep and decide.startswith("clef-gguf demo ./demo-model && "), first
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", "-c", decide], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    response = json.loads(proc.stdout[proc.stdout.rindex('{\n  "model"'):])  # demo printed its summary first
    assert set(response["answers"]) == {"overdue", "action", "risk"}
    (python,) = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), re.DOTALL)
    proc = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]

"""ServerSettings (``clef_gguf.server.settings``): ``serve``'s and ``ui``'s server flags are generated from it,
each setting may come from its environment variable (a flag given wins, then the variable, then the
default), a bad variable is refused naming it, and ``serve``, ``ui`` and the Ray Serve path build their
app from the one object."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys

import pytest

from clef_gguf.cli import build_parser
from clef_gguf.core import errors
from clef_gguf.core.commandline import GIVEN
from clef_gguf.media.sources import INLINE_ONLY
from clef_gguf.server.app import create_app
from clef_gguf.server.guard import SitePolicy
from clef_gguf.server.settings import ServerSettings

FIELDS = ServerSettings.model_fields


@pytest.fixture(autouse=True)
def _no_server_variables(monkeypatch):
    """The tests set the variables they mean; none leaks in from the machine's environment."""
    for name in FIELDS:
        monkeypatch.delenv(ServerSettings.env_var(name), raising=False)


def _command(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def _actions(command: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _command(command)._actions if a.dest in FIELDS}


def _settings(*argv: str, command: str = "serve") -> ServerSettings:
    return ServerSettings.from_args(build_parser(command).parse_args([command, "--model", "m", *argv]))


def test_every_field_has_exactly_one_flag_its_default_and_help_from_the_declaration():
    actions = _actions("serve")
    assert set(actions) == set(FIELDS)
    options = [o for a in actions.values() for o in a.option_strings]
    assert len(options) == len(set(options)) == len(FIELDS)  # one spelling each, none shared
    for name, action in actions.items():
        spec, var = FIELDS[name], ServerSettings.env_var(name)
        assert action.help == f"{spec.description} [env: {var}]", name
        assert var == "CLEF_GGUF_" + action.option_strings[0].removeprefix("--").replace("-", "_").upper()
        if action.nargs == 0:  # a switch
            assert action.default is False and spec.default is False
        elif isinstance(action, argparse._AppendAction):
            assert action.default is None and spec.default == ()
        else:
            assert action.default == spec.default, name
    assert _settings() == ServerSettings()  # no flag, no variable: the declared defaults


def test_ui_is_the_same_declaration_with_its_overrides():
    serve, ui = _actions("serve"), _actions("ui")
    assert set(serve) - set(ui) == {"no_ui"}  # the page is what `ui` serves
    assert ui["port"].default == 0 and ui["port"].help.startswith("port (default: a free one)")
    for name in ui:
        if name != "port":
            assert (ui[name].option_strings, ui[name].default, ui[name].help, ui[name].type) == \
                (serve[name].option_strings, serve[name].default, serve[name].help, serve[name].type), name
    assert _settings("--no-browser", command="ui") == ServerSettings(port=0)


def test_help_says_how_the_environment_is_read():
    text = " ".join(_command("serve").format_help().split())
    assert "a flag given wins over its variable, a variable over the default" in text
    assert "--api-key API_KEY" in text and "[env: CLEF_GGUF_API_KEY]" in text


def test_a_variable_sets_a_setting_and_a_flag_overrides_it(monkeypatch):
    monkeypatch.setenv("CLEF_GGUF_PORT", "9000")
    monkeypatch.setenv("CLEF_GGUF_HOST", "0.0.0.0")
    monkeypatch.setenv("CLEF_GGUF_DRAIN_TIMEOUT", "2.5")
    monkeypatch.setenv("CLEF_GGUF_ENGINE", "ray-serve")
    got = _settings()
    assert (got.port, got.host, got.drain_timeout, got.engine) == (9000, "0.0.0.0", 2.5, "ray-serve")
    assert _settings("--port", "9100").port == 9100
    assert _settings("--port", "8080").port == 8080  # given, though it is the default: the flag wins
    assert _settings("--host", "127.0.0.1").host == "127.0.0.1"
    assert _settings(command="ui").port == 9000  # `ui` reads the same variables


def test_the_api_key_variable_as_before(monkeypatch):
    monkeypatch.setenv("CLEF_GGUF_API_KEY", "s3cret")
    got = _settings()
    assert got.api_key == "s3cret" and "s3cret" not in repr(got)
    assert _settings("--api-key", "other").api_key == "other"
    monkeypatch.setenv("CLEF_GGUF_API_KEY", "")  # empty: unset, as it always was
    assert _settings().api_key is None


def test_repeatable_flags_and_switches_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CLEF_GGUF_ALLOWED_HOST", "Clef.LAN, [::1]:8080")
    monkeypatch.setenv("CLEF_GGUF_CORS_ORIGIN", "https://app.example:443")
    monkeypatch.setenv("CLEF_GGUF_MEDIA_ALLOW_URL", "example.com,https://cdn.example.com/img/")
    monkeypatch.setenv("CLEF_GGUF_MEDIA_ALLOW_FILES", str(tmp_path))
    monkeypatch.setenv("CLEF_GGUF_NO_UI", "yes")
    got = _settings()
    assert got.site == SitePolicy(("clef.lan", "[::1]:8080"), ("https://app.example",))  # checked as the flags
    assert got.media_policy.url_allow == ("example.com", "https://cdn.example.com/img/")
    assert got.media_policy.file_roots == (tmp_path.resolve(),) and got.no_ui
    flagged = _settings("--allowed-host", "other.lan", "--media-allow-files")  # flags replace, not add
    assert flagged.allowed_hosts == ("other.lan",) and flagged.media_allow_files == (".",)
    monkeypatch.setenv("CLEF_GGUF_NO_UI", "0")
    assert _settings().no_ui is False and _settings("--no-ui").no_ui is True


@pytest.mark.parametrize("var, value, says", [
    ("CLEF_GGUF_PORT", "70000", "must be a port number from 0 to 65535"),
    ("CLEF_GGUF_PORT", "http", "expected a port number"),
    ("CLEF_GGUF_QUEUE_SIZE", "0", "must be at least 1"),
    ("CLEF_GGUF_DRAIN_TIMEOUT", "nan", "must be >= 0"),
    ("CLEF_GGUF_ENGINE", "gunicorn", "invalid choice"),
    ("CLEF_GGUF_ALLOWED_HOST", "ok.lan,bad host", "expected a host name"),
    ("CLEF_GGUF_CORS_ORIGIN", "127.0.0.1:3000", "expected an origin"),
    ("CLEF_GGUF_NO_UI", "maybe", "expected 1/true/yes/on")])
def test_a_bad_variable_is_refused_naming_it(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(errors.InvalidSetting) as info:
        _settings()
    assert info.value.field == var and var in info.value.message and says in info.value.message
    assert info.value.exit_code == 2


def test_a_bad_variable_exits_2_before_anything_loads(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLEF_GGUF_")} | {"CLEF_GGUF_PORT": "70000"}
    for entry in (["-m", "clef_gguf.cli", "serve"], ["-m", "clef_gguf.server"], ["-m", "clef_gguf.cli", "ui"]):
        proc = subprocess.run([sys.executable, *entry, "--model", str(tmp_path / "absent")], capture_output=True,
                              text=True, timeout=120, env=env, cwd=tmp_path)
        assert proc.returncode == 2, (entry, proc.stderr)
        assert "CLEF_GGUF_PORT='70000'" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["error"]["field"] == "CLEF_GGUF_PORT"  # the CLI's error body names it


def test_the_app_is_built_from_the_settings_in_one_place(tmp_path):
    got = _settings("--api-key", "k", "--no-ui", "--max-batch", "3", "--media-allow-files", str(tmp_path))
    kwargs = got.app_kwargs()
    assert set(kwargs) <= set(inspect.signature(create_app).parameters)
    assert kwargs["ui"] is False and kwargs["max_batch"] == 3 and kwargs["api_key"] == "k"
    assert kwargs["media_policy"].file_roots == (tmp_path.resolve(),)
    assert ServerSettings().app_kwargs()["media_policy"] == INLINE_ONLY
    app = create_app(object(), **kwargs)  # any model object: the app is built, not served
    assert app.state.queue is not None


def test_the_ray_serve_path_reads_back_what_serve_resolved(monkeypatch):
    monkeypatch.setenv("CLEF_GGUF_PORT", "9000")
    args = build_parser("serve").parse_args(["serve", "--model", "m", "--replicas", "2"])
    resolved = ServerSettings.from_args(args)
    handed = resolved.onto(args)
    monkeypatch.setenv("CLEF_GGUF_PORT", "9999")  # read once: the copy says what serve resolved
    assert ServerSettings.from_args(handed) == resolved and (handed.port, handed.replicas) == (9000, 2)
    assert handed.model == "m" and set(FIELDS) <= getattr(handed, GIVEN)


def test_settings_from_the_environment_alone(monkeypatch):
    monkeypatch.setenv("CLEF_GGUF_API_KEY", "k")
    monkeypatch.setenv("CLEF_GGUF_QUEUE_SIZE", "7")
    assert (ServerSettings.from_environment().api_key, ServerSettings.from_environment().queue_size) == ("k", 7)
    assert ServerSettings.from_environment(queue_size=3).queue_size == 3
    monkeypatch.setenv("CLEF_GGUF_QUEUE_SIZE", "-1")
    with pytest.raises(errors.InvalidSetting, match="CLEF_GGUF_QUEUE_SIZE"):
        ServerSettings.from_environment()


def test_bad_values_in_python_are_refused_naming_the_flag():
    with pytest.raises(errors.InvalidSetting, match="--port") as info:
        ServerSettings.checked({"port": 70000})
    assert info.value.field == "port"
    with pytest.raises(errors.InvalidSetting, match="unknown setting"):
        ServerSettings.checked({"bogus": 1})


def test_the_server_page_names_every_variable():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text(encoding="utf-8")
    for name in FIELDS:
        assert f"| `{ServerSettings.env_var(name)}` | `{ServerSettings.option(name)}`" in page, name

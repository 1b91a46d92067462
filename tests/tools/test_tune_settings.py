"""TuneSettings (``clef_gguf.tools.tune_command``): ``clef-gguf tune``'s flags are generated from it, one per
field, with the declaration's defaults and help; bad values are refused by the flags (exit 2, naming them)."""

from __future__ import annotations

import argparse

import pytest

from clef_gguf.cli import build_parser
from clef_gguf.tools import tune
from clef_gguf.tools.tune_command import TuneSettings

FIELDS = TuneSettings.model_fields


def _command() -> argparse.ArgumentParser:
    parser = build_parser("tune")
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["tune"]


def _settings(*argv: str) -> TuneSettings:
    return TuneSettings.from_args(build_parser("tune").parse_args(["tune", *argv]))


def test_every_field_has_exactly_one_flag_its_default_and_help_from_the_declaration():
    actions = {a.dest: a for a in _command()._actions if a.dest != "help"}
    assert set(actions) == set(FIELDS)
    assert [a.option_strings for a in actions.values()] == [
        ["--model", "-m"], ["--gpu-layers"], ["--offline"], ["--lengths"], ["--rounds"], ["--only"], ["--show"],
        ["--json"]]
    for name, action in actions.items():
        assert action.help == FIELDS[name].description, name  # tune reads no environment
        if name == "model":
            assert action.required
        else:
            assert action.default == FIELDS[name].default, name


def test_the_flags_give_the_settings():
    assert _settings("-m", "x") == TuneSettings(model="x")
    got = _settings("--model", "x", "--gpu-layers", "0", "--offline", "--lengths", "8,16", "--rounds", "3",
                    "--only", "threads, pack_size", "--show", "--json")
    assert got == TuneSettings(model="x", gpu_layers=0, offline=True, lengths=(8, 16), rounds=3,
                               only=["threads", "pack_size"], show=True, as_json=True)
    assert _settings("-m", "x").lengths == tune.DEFAULT_LENGTHS and _settings("-m", "x").rounds == tune.DEFAULT_ROUNDS


@pytest.mark.parametrize("argv, flag", [
    ([], "--model"), (["-m", "x", "--rounds", "0"], "--rounds"), (["-m", "x", "--lengths", "0"], "--lengths"),
    (["-m", "x", "--lengths", "a,b"], "--lengths"), (["-m", "x", "--gpu-layers", "some"], "--gpu-layers")])
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser("tune").parse_args(["tune", *argv])
    assert info.value.code == 2 and flag in capsys.readouterr().err

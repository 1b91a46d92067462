"""LoadSettings (``clef_gguf.runtime.settings``): the flags are generated from it, values are checked
there, the Ray copies keep every field; and every flag reaches the model the local engine loads."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest

from clef_gguf.core import errors
from clef_gguf.runtime.flags import load_model
from clef_gguf.runtime.settings import LoadSettings, for_replicas
from settings_helpers import argv, calibration_for, every_flag, expected_info


def _parser() -> argparse.ArgumentParser:
    from clef_gguf.cli import build_parser

    return build_parser("decide")


@pytest.fixture(scope="module")
def flags(tiny_model_dir, tiny_fine_tunes, tmp_path_factory):
    cal_path = tmp_path_factory.mktemp("cal") / "cal.json"
    version = calibration_for(tiny_model_dir, cal_path).version
    return every_flag(tiny_model_dir, tiny_fine_tunes["a"], cal_path), version


def test_one_flag_per_field_with_the_fields_help():
    parser = argparse.ArgumentParser()
    LoadSettings.add_arguments(parser)
    dests = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(dests) == set(LoadSettings.model_fields)
    assert dests["threads"].help == LoadSettings.model_fields["threads"].description
    assert dests["head_dtype"].option_strings == ["--head-dtype", "--precision"]
    assert dests["allow_download"].option_strings == ["--offline"] and "never download" in dests["allow_download"].help
    assert dests["backend"].choices == ["auto", "gguf", "nvfp4"]
    assert dests["vision_engine"].choices == ["exact", "int8"] and dests["vision_engine"].default == "exact"


def test_the_test_drives_every_field(flags):
    assert set(flags[0]) == set(LoadSettings.model_fields)  # a new setting needs a row in every_flag


def test_defaults_of_the_command_line_and_the_python_api():
    args = _parser().parse_args(["decide", "-m", "x"])
    cli = LoadSettings.from_args(args)
    assert cli.allow_download is True and LoadSettings().allow_download is False  # --offline turns it off
    assert cli.model_copy(update={"allow_download": False}) == LoadSettings(model="x")


@pytest.mark.parametrize("values, field", [
    ({"threads": 0}, "threads"), ({"threads": True}, "threads"), ({"head_threads": -1}, "head_threads"),
    ({"head_dtype": "fp8"}, "head_dtype"), ({"gpu_layers": -2}, "gpu_layers"), ({"backend": "onnx"}, "backend"),
    ({"state_cache_mb": -1}, "state_cache_mb"), ({"vision_cache_mb": -1}, "vision_cache_mb"),
    ({"vision_engine": "fp16"}, "vision_engine"),
    ({"max_length": 0}, "max_length"), ({"bogus": 1}, "bogus"), ({"decode_chunk": 0}, "decode_chunk"),
    ({"pack_size": 0}, "pack_size"), ({"flash_attention": "maybe"}, "flash_attention"),
    ({"adapters": ["/x"]}, "adapters")])
def test_bad_settings_name_their_field(values, field):
    with pytest.raises(errors.InvalidSetting) as exc:
        LoadSettings.of(**values)
    assert exc.value.field == field and field in exc.value.message


def test_none_is_auto_for_backend_and_gpu_layers_as_clef_load_always_took_them():
    got = LoadSettings.of(backend=None, gpu_layers=None)
    assert (got.backend, got.gpu_layers) == ("auto", "auto")


def test_bad_flags_exit_2(capsys):
    for bad in (["--threads", "0"], ["--gpu-layers", "some"], ["--head-dtype", "fp8"], ["--state-cache-mb", "-3"]):
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args(["decide", "-m", "x", *bad])
        assert exc.value.code == 2


def test_key_value_strings_are_checked_as_flags():
    got = LoadSettings.from_strings({"model": "m", "threads": "3", "strict": "true", "head_threads": "2",
                                     "offline": "true"})
    assert (got.threads, got.strict, got.head_threads, got.allow_download) == (3, True, 2, False)
    assert LoadSettings.from_strings({"model": "m"}).allow_download is True
    assert LoadSettings.from_strings({"model": "m", "allow_download": "true"}).allow_download is True
    assert LoadSettings.from_strings({"model": "m", "allow_download": "false"}).allow_download is False
    assert LoadSettings.from_strings({"model": "m", "offline": "false"}).allow_download is True
    for bad in ({"model": "m", "threads": "0"}, {"model": "m", "nope": "1"}):
        with pytest.raises(errors.InvalidSetting):
            LoadSettings.from_strings(bad)


def test_worker_copies_keep_every_field_and_make_paths_absolute(flags, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(flags[0]["model"][1]).parent)
    relative = {k: [w if not w.startswith("/") else str(Path(w).relative_to(Path.cwd()))
                    if Path(w).is_relative_to(Path.cwd()) else w for w in v] for k, v in flags[0].items()}
    args = _parser().parse_args(["decide", *argv(relative)])
    settings = LoadSettings.from_args(args)
    shipped = pickle.loads(pickle.dumps(for_replicas(args, None, 2)))
    for name in LoadSettings.model_fields:
        if name not in ("threads", "model", "gguf", "head", "head_config", "tokenizer", "calibration", "adapters"):
            assert getattr(shipped, name) == getattr(settings, name), name
    assert shipped.threads == 1 and Path(shipped.model).is_absolute() and Path(shipped.gguf).is_absolute()
    assert all(Path(p).is_absolute() for p in shipped.adapters.values())
    assert Path(shipped.calibration).is_absolute()
    assert for_replicas(args, 3, 2).threads == 3


def test_every_flag_reaches_the_model_the_local_engine_loads(flags):
    got, version = flags
    args = _parser().parse_args(["decide", *argv(got)])
    with load_model(args) as models:
        assert set(models) == {models.base.name, "ft"} and models.default == models.base.name
        base = models.default_model
        assert base.settings == LoadSettings.from_args(args)
        assert {k: base.info[k] for k in expected_info(version)} == expected_info(version)
        assert base.state_cache.max_bytes == 7 << 20 and base.strict and base.calibration.version == version
        assert base.media.cache is not None and base.media.cache.max_bytes == 5 << 20
        assert base.media.engine == "int8"
        assert str(base.head_dtype) == "torch.bfloat16" and base.tower.n_ctx == 1024
        assert (base.tower.n_batch, base.tower.pack_rule.pack, base.settings.tune) == (256, 2, False)
        assert base.settings.allow_download is False  # --offline
        assert models["ft"].settings == base.settings and models["ft"].provenance.fine_tune["name"] == "ft"
        assert models.base is base  # the calibrated base is the one the set holds, closes and routes to

"""Loading with what `clef-gguf tune` kept: a tuned value fills only what no setting gives, an explicit
flag or keyword wins, --no-tune keeps the defaults, and the commands' flags get there."""

from __future__ import annotations

import argparse

import pytest

from clef_gguf.formats.files import from_directory
from clef_gguf.models import tuned
from clef_gguf.runtime import tuning
from clef_gguf.runtime.flags import add_model_arguments, load_model
from clef_gguf.runtime.model import Clef
from clef_gguf.runtime.settings import LoadSettings

CHOSEN = {"threads": 1, "decode_chunk": 256, "pack_size": 2, "flash_attention": "off", "head_dtype": "bf16"}


def keep(tower, chosen=CHOSEN):
    tuned.store(tuned.Tuning(str(tower.resolve()), "cpu", tuned.machine_hash("cpu"), {}, dict(chosen)))


@pytest.fixture
def tower(fake_tower):
    return fake_tower


def test_tuned_values_fill_only_what_no_setting_gives(tower):
    keep(tower)
    run = tuning.for_tower(LoadSettings.of(model="m"), tower, "cpu")
    assert (run.threads, run.decode_chunk, run.pack, run.attention, run.head_dtype) == (1, 256, 2, "flash-off", "bf16")
    assert run.from_tune == CHOSEN
    given = tuning.for_tower(LoadSettings.of(model="m", threads=2, decode_chunk=512, pack_size=4,
                                             flash_attention="on", head_dtype="fp32"), tower, "cpu")
    assert (given.threads, given.decode_chunk, given.pack, given.attention, given.head_dtype) == \
        (2, 512, 4, "flash-on", "fp32")  # an explicit value wins, even the default's
    assert given.from_tune == {}
    off = tuning.for_tower(LoadSettings.of(model="m", tune=False), tower, "cpu")
    assert (off.threads, off.decode_chunk, off.pack, off.attention, off.head_dtype) == (None, 512, None, None, "fp32")
    assert tuning.for_tower(LoadSettings.of(model="m"), tower, "gpu").from_tune == {}  # tuned on the CPU only


def test_the_command_line_flags_reach_the_tuning(tower):
    keep(tower)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)

    def run(*argv):
        return tuning.for_tower(LoadSettings.from_args(parser.parse_args(["--model", "m", *argv])), tower, "cpu")

    assert run().from_tune == CHOSEN
    assert run("--no-tune").from_tune == {}
    assert run("--head-dtype", "fp32", "--threads", "2").from_tune == {k: v for k, v in CHOSEN.items()
                                                                      if k not in ("head_dtype", "threads")}
    assert LoadSettings.from_strings({"model": "m", "tune": "false"}).tune is False


def test_a_model_loads_with_its_tuned_settings_and_without_them(tiny_model_dir_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = tiny_model_dir_factory("q8_0")
    request = {"state": "A customer asks for a refund.",
               "questions": {"q": {"type": "noul", "instructions": "Refund?"}}}
    with Clef.load(model) as clef:  # nothing kept: the defaults
        assert (clef.tower.n_batch, clef.tower.pack_rule.pack, clef.info["tuned"]) == (512, 4, {})
        before = clef.probabilities(request)
    keep(from_directory(model).tower, {"threads": 1, "decode_chunk": 256, "pack_size": 2, "flash_attention": "off"})
    with Clef.load(model) as clef:
        assert (clef.tower.threads, clef.tower.n_batch, clef.tower.pack_rule.pack, clef.tower.attention) == \
            (1, 256, 2, "flash-off")
        assert clef.info["tuned"]["decode_chunk"] == 256
        after = clef.probabilities(request)
    assert max(abs(a - b).max() for a, b in zip(before, after)) <= 1e-4
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    with load_model(parser.parse_args(["--model", str(model), "--no-tune"])) as models:  # a command's opt-out
        tower = models.default_model.tower
        assert (tower.n_batch, tower.pack_rule.pack, tower.attention) == (512, 4, "default")
    with load_model(parser.parse_args(["--model", str(model), "--decode-chunk", "128"])) as models:
        assert models.default_model.tower.n_batch == 128  # the flag beats the tuned 256
        assert models.default_model.tower.threads == 1  # the rest still tuned

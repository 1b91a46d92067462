"""Every load flag through the Ray engines, asserted where the model loaded: in a Ray Data actor
(``batch --engine ray``'s ``Decider``, sent the settings ``batch`` sends) and in a Ray Serve replica
(``serve --engine ray-serve`` with every flag, read back from its ``/v1/models``)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from clef_gguf.runtime.settings import LoadSettings
from settings_helpers import argv, calibration_for, every_flag, expected_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import serve_process, wait_healthy  # noqa: E402


@pytest.fixture(scope="module")
def flags(tiny_model_dir, tiny_fine_tunes, tmp_path_factory):
    cal_path = tmp_path_factory.mktemp("cal") / "cal.json"
    version = calibration_for(tiny_model_dir, cal_path).version
    return every_flag(tiny_model_dir, tiny_fine_tunes["a"], cal_path), version


def test_every_flag_reaches_a_ray_data_actor(flags):
    import ray

    from clef_gguf.bulk.job import actor_settings
    from clef_gguf.bulk.ray_engine import Decider
    from clef_gguf.cli import build_parser

    got, version = flags
    args = build_parser("batch").parse_args(["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--engine", "ray",
                                             *argv(got)])
    settings = actor_settings(args)  # what `batch --engine ray` sends each actor
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        actor = ray.remote(Decider).options(num_cpus=1).remote(settings, 8, False)
        info, loaded, names = ray.get(actor.__ray_call__.remote(
            lambda self: (dict(self.clef.default_model.info), self.clef.default_model.settings, sorted(self.clef))),
            timeout=600)
    finally:
        ray.shutdown()
    assert loaded == LoadSettings.from_args(args).model_copy(update={"threads": settings.threads})
    assert {k: info[k] for k in expected_info(version)} == expected_info(version)
    assert "ft" in names


def test_every_flag_reaches_a_ray_serve_replica(flags, tmp_path):
    got, version = flags
    with serve_process(tmp_path, *argv(got), "--engine", "ray-serve", "--replicas", "1") as (proc, url, _port):
        wait_healthy(proc, url)
        models = httpx.get(url + "/v1/models", timeout=60).json()["models"]
    default = next(m for m in models if m["default"])
    assert {k: default[k] for k in expected_info(version)} == expected_info(version)
    assert [m["name"] for m in models if not m["default"]] == ["ft"]
    assert default["files"].keys() >= {"tower-f32.gguf", "joint_head.safetensors", "tokenizer.json"}

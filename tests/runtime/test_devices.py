"""``head_device``: the head beside the tower or on the CPU, chosen by the setting; an impossible device
refused by name before anything loads (the Python API, decide, serve); the nvfp4 backend honours it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from clef_gguf import Clef
from clef_gguf.cli import main
from clef_gguf.core import errors
from clef_gguf.runtime import devices

REQUEST = {"state": "Invoice INV-7 is 40 days past due.", "questions": {"overdue": {"type": "noul"}}}


def test_auto_and_cpu_run_the_head_on_the_cpu_here_with_the_same_answers(tiny_model_dir):
    with Clef.load(tiny_model_dir, head_device="cpu") as cpu, Clef.load(tiny_model_dir) as auto:
        assert cpu.info["head_device"] == auto.info["head_device"] == "cpu"
        assert cpu.head_device == torch.device("cpu")
        assert cpu.decide(REQUEST) == auto.decide(REQUEST)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA: cuda is a valid head device")
@pytest.mark.parametrize("asked", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_refused_before_any_file_loads(asked, tmp_path):
    with pytest.raises(errors.InvalidSetting, match="has a CPU-only build|no CUDA device") as caught:
        Clef.load(tmp_path / "no-such-model", head_device=asked)  # not model_not_found: refused first
    assert caught.value.field == "head_device" and caught.value.exit_code == 2


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "CPU0", "cuda:-1"])
def test_a_misspelt_device_is_an_invalid_setting(bad, tiny_model_dir):
    with pytest.raises(errors.InvalidSetting, match="head_device") as caught:
        Clef.load(tiny_model_dir, head_device=bad)
    assert caught.value.field == "head_device"


def test_the_choice_follows_the_tower_when_torch_sees_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.head_device("auto", 1) == torch.device("cuda", 1)  # beside the tower's layers
    assert devices.head_device("auto", None) == torch.device("cpu")  # the tower is on the CPU
    assert devices.head_device("cuda", None) == torch.device("cuda", 0)
    assert devices.head_device("cuda:1", 0) == torch.device("cuda", 1)
    assert devices.head_device("cpu", 0) == torch.device("cpu")
    with pytest.raises(errors.InvalidSetting, match="torch sees 2 CUDA device"):
        devices.head_device("cuda:2", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.head_device("auto", 0) == torch.device("cpu")  # a llama.cpp GPU torch cannot see


def test_decide_and_serve_refuse_it_with_exit_2(tiny_model_dir, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    request = tmp_path / "r.json"
    request.write_text(json.dumps(REQUEST))
    assert main(["decide", "--model", str(tiny_model_dir), "--head-device", "cuda", "--request", str(request)]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert (error["code"], error["field"]) == ("invalid_setting", "head_device")
    with pytest.raises(SystemExit) as parsed:  # a spelling argparse refuses
        main(["decide", "--model", str(tiny_model_dir), "--head-device", "gpu"])
    assert parsed.value.code == 2
    # serve refuses before binding a port: exits 2 at once with the message
    proc = subprocess.run([sys.executable, "-m", "clef_gguf.server", "--model", str(tiny_model_dir), "--port", "0",
                           "--head-device", "cuda"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "head_device" in proc.stderr and "Uvicorn running" not in proc.stderr


def test_the_nvfp4_backend_honours_it(tiny_nvfp4_dir):
    with Clef.load(tiny_nvfp4_dir("nvfp4a16"), head_device="cpu") as clef:
        assert clef.info["head_device"] == "cpu" and clef.decide(REQUEST)["answers"]["overdue"]["noul"] >= 0
    if not torch.cuda.is_available():
        with pytest.raises(errors.InvalidSetting, match="head_device"):
            Clef.load(tiny_nvfp4_dir("nvfp4a16"), head_device="cuda")

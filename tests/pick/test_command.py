"""``clef-gguf pick``: this machine's profile and recommendation, and what it says of NVFP4 on (fake) GPUs."""

from __future__ import annotations

import argparse
import json

import pytest

from machine_helpers import H200, RTX5090, X86, box
from clef_gguf.pick import command as pick
from clef_gguf.core.errors import InvalidValue
from clef_gguf.core.limits import GiB
from clef_gguf.models.machine import DeviceProfile


@pytest.mark.parametrize("as_json", [False, True])
def test_pick_command_on_this_machine(capsys, as_json):
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    code = pick.run(parser.parse_args(["--no-probe", "--json"] if as_json else ["--no-probe"]))
    out = capsys.readouterr().out
    if as_json:
        data = json.loads(out)
        assert data["device"]["total_ram"] > 0 and "avx2" in data["device"]["features"]
        rec = data["recommendation"]
        assert rec["family"] == "clef-flash" and rec["context_tokens"] == 16384
        assert code == (0 if rec["ok"] else 1) and len(rec["candidates"]) >= 30
    else:
        assert out.startswith("RAM:") and "CPU:" in out and "GPU:" in out and "Recommended:" in out
        assert code in (0, 1)


@pytest.mark.parametrize("gpu, words", [
    (RTX5090, "native FP4 (Blackwell, compute capability 12.0)"),
    (H200, "dequantizing fallback (no FP4 tensor cores: NVIDIA H200, cc 9.0)"),
])
def test_pick_says_whether_the_gpu_has_native_fp4(monkeypatch, capsys, gpu, words):
    monkeypatch.setattr(pick, "probe", lambda **_: box(gpu, ram=256))
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    assert "clef-flash:nvfp4a16" in parser.format_help() and "Blackwell" in parser.format_help()
    assert pick.run(parser.parse_args(["--no-probe"])) == 0
    out = capsys.readouterr().out
    gpu_line = next(line for line in out.splitlines() if line.startswith("GPU:"))
    assert f"NVFP4: {words}" in gpu_line
    assert "NVFP4 checkpoints (nvfp4 backend; pulled by name, never chosen automatically):" in out
    assert f"+ clef-flash:NVFP4 (W4A4, by name only) fits: {words}" in out
    assert "+ clef-flash:NVFP4A16 (W4A16, by name only) fits: dequantizing fallback" in out
    assert pick.run(parser.parse_args(["--no-probe", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"]["gpus"][0]["compute_capability"] == gpu.compute_capability
    rows = {r["quant"]: r for r in data["recommendation"]["nvfp4"]}
    assert set(rows) == {"NVFP4A16", "NVFP4"} and rows["NVFP4A16"]["need_bytes"] > 7 * GiB
    assert rows["NVFP4"]["mode"] == ("native" if gpu is RTX5090 else "fallback")
    assert rows["NVFP4A16"]["mode"] == "fallback"
    assert data["recommendation"]["name"].split(":")[1] not in rows  # auto stays GGUF


def test_pick_without_a_gpu_lists_nvfp4_as_not_suitable(monkeypatch, capsys):
    monkeypatch.setattr(pick, "probe", lambda **_: DeviceProfile(32 * GiB, 26 * GiB, 16, "x86_64", X86))
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    assert pick.run(parser.parse_args(["--no-probe"])) == 0
    out = capsys.readouterr().out
    assert "GPU:  none" in out and "- clef-flash:NVFP4A16 (W4A16) is not suitable here: no CUDA GPU" in out
    # its NVFP4 GGUF runs here: llama.cpp on the CPU, budgeted as a GGUF of the checkpoint's bytes
    assert "use a GGUF K-quant, the fast CPU path (clef-flash:nvfp4a16-gguf runs this checkpoint" in out
    assert ("as an NVFP4 GGUF, clef-flash:nvfp4a16-gguf (llama.cpp, re-encoded on first use): ~" in out
            and "fits on the CPU (pick --quants NVFP4A16-GGUF times it)" in out)
    assert pick.run(parser.parse_args(["--no-probe", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    gguf = {n["quant"]: n["gguf"] for n in data["recommendation"]["nvfp4"]}
    assert gguf["NVFP4A16"]["quant"] == "NVFP4A16-GGUF" and gguf["NVFP4A16"]["fits"]
    # 4 GiB packed + 2 x 2.03 GB of bf16 embeddings and output matrix
    assert not gguf["NVFP4A16"]["fits_gpu"] and 8e9 < gguf["NVFP4A16"]["size_bytes"] < 9e9
    table = {r["quant"]: r for r in data["table"]}
    assert table["NVFP4-GGUF"]["by_name"] and table["NVFP4-GGUF"]["seconds"] is None


def test_pick_refuses_an_nvfp4_gguf_the_family_does_not_have(monkeypatch):
    monkeypatch.setattr(pick, "probe", lambda **_: DeviceProfile(32 * GiB, 26 * GiB, 16, "x86_64", X86))
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    with pytest.raises(InvalidValue, match="NVFP4A8-GGUF not published for clef-flash") as caught:
        pick.run(parser.parse_args(["--quants", "NVFP4A8-GGUF"]))
    assert caught.value.field == "quants" and "NVFP4A16-GGUF" in str(caught.value)


def test_pick_times_the_nvfp4_ggufs_only_when_named(monkeypatch):
    monkeypatch.setattr(pick, "probe", lambda **_: DeviceProfile(32 * GiB, 26 * GiB, 16, "x86_64", X86))
    asked: list[list[str]] = []
    monkeypatch.setattr(pick.speed, "measure", lambda family, quants, **_: asked.append(list(quants)))
    parser = argparse.ArgumentParser()
    pick.add_arguments(parser)
    pick.run(parser.parse_args([]))
    pick.run(parser.parse_args(["--quants", "Q4_K_M,NVFP4-GGUF"]))
    assert asked[0] and not [q for q in asked[0] if q.endswith("-GGUF")] and "Q4_K_M" in asked[0]
    assert asked[1] == ["Q4_K_M", "NVFP4-GGUF"]

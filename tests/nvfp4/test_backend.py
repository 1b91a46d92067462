"""The nvfp4 backend end to end on the tiny release quantized to NVFP4A16 and NVFP4 (W4A4):
backend choice, the model wiring against transformers on the same (dequantized) weights, the
decisions against the f32 GGUF path, exact reuse, the CLI, the server and load-time failures."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.formats import files
from clef_gguf.pipeline.answer import split_probabilities
from clef_gguf.tower.nvfp4 import reference
from clef_gguf.tower.nvfp4.checkpoint import Checkpoint
from clef_gguf.convert.samples import SAMPLE_REQUESTS
from clef_gguf.runtime.stages import head_logits

STANDIN = Path(__file__).parent / "fla_standin"  # a stand-in for flash-linear-attention

REQUEST = SAMPLE_REQUESTS[1]
# On the random tiny256 release (seed 0) against its f32 GGUF conversion, over SAMPLE_REQUESTS:
# measured max |dp| 0.019 (NVFP4A16) and 0.040 (NVFP4), where the GGUF Q4_K_M gives 0.050 and
# Q4_0 0.061 on the same model; the bounds leave room for float noise, not for a wrong scale.
MAX_DP = {"nvfp4a16": 0.03, "nvfp4": 0.06}


@pytest.fixture(scope="module", params=["nvfp4a16", "nvfp4"])
def scheme(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(scheme, tiny_nvfp4_dir):
    return tiny_nvfp4_dir(scheme)


@pytest.fixture(scope="module")
def clef(model_dir):
    with Clef.load(model_dir, max_length=2048, threads=2) as model:
        yield model


def test_a_checkpoint_directory_selects_the_nvfp4_backend(clef, scheme, model_dir):
    assert files.from_directory(model_dir).backend == "nvfp4"
    out = clef.decide(REQUEST)
    assert list(out["answers"]) == list(REQUEST["questions"])
    assert out["audit"]["backend"] == "torch-nvfp4"
    assert out["audit"]["precision"] == {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}[scheme]
    assert clef.info["device"] == "cpu" and clef.info["gpu_layers"] == 0
    assert clef.info["kernel"].startswith("dense weights dequantized once at load")  # the tiny model fits
    assert clef.info["lexical_rows"] == "BF16"


# bf16 against the bf16 reference, max |dp|: measured 6.3e-4 (NVFP4A16) and 2.4e-3 (W4A4: a bf16 rounding
# moves activations across FP4 codes) on this model; the GPU check's bar for NVFP4A16 is 1e-2
BF16_BARS = {"nvfp4a16": 5e-3, "nvfp4": 2e-2}


def test_the_tower_is_the_reference_model_on_the_dequantized_weights(clef, scheme, model_dir, tiny_release):
    checkpoint = Checkpoint(model_dir / files.CHECKPOINT_CONFIG)
    ref = reference.reference_model(tiny_release, checkpoint)
    enc = clef.prepare(REQUEST).encoded
    ours = clef.tower.hidden_states(enc.ids)
    theirs = reference.reference_hidden_states(ref, enc.ids)
    assert ours.shape == theirs.shape
    assert float(np.abs(ours - theirs).max()) < 2e-4 * max(1.0, float(np.abs(theirs).max()))  # measured: 0
    # the GPU check's comparison, here on the CPU: both in bf16, the same weights through the reference's layers
    bf16 = reference.reference_model(tiny_release, checkpoint, dtype=torch.bfloat16)
    with Clef.load(model_dir, state_cache_mb=0, nvfp4_dtype="bf16") as ours16:
        got = ours16.tower.hidden_states(enc.ids)
    want = reference.reference_hidden_states(bf16, enc.ids)
    dp = np.abs(clef.flat_probabilities(enc, got) - clef.flat_probabilities(enc, want)).max()
    assert 0 < dp < BF16_BARS[scheme]  # bf16 is not fp32 (0 would mean fp32 ran), and close to the reference


@pytest.fixture(scope="module")
def tiny256(tmp_path_factory):
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release

    root = tmp_path_factory.mktemp("tiny256")
    release = build_release(root / "release", preset="tiny256", seed=0)
    return release, convert_release(release, root / "f32", outtype="f32")


def test_decisions_stay_near_the_f32_gguf_path(tiny256, scheme, tmp_path):
    from clef_gguf.convert.nvfp4 import quantize_release

    release, f32 = tiny256
    quantized = quantize_release(release, tmp_path / scheme, scheme=scheme)
    worst = 0.0
    with Clef.load(quantized, threads=2, state_cache_mb=0) as ours, \
            Clef.load(f32, threads=2, state_cache_mb=0) as ref:
        for request in SAMPLE_REQUESTS:
            for a, b in zip(ours.probabilities(request), ref.probabilities(request)):
                worst = max(worst, float(np.abs(a - b).max()))
    assert 0.001 < worst < MAX_DP[scheme]  # > 0.001: the quantization really ran


def test_segments_and_cache_reuse_give_the_same_bytes(model_dir, scheme):
    other = {**REQUEST, "questions": {"bug": {"type": "noul"}}}
    with Clef.load(model_dir, max_length=2048, threads=2, state_cache_mb=0) as plain, \
            Clef.load(model_dir, max_length=2048, threads=2) as cached:
        expected = [plain.decide(REQUEST), plain.decide(other)]
        got = [cached.decide(REQUEST), cached.decide(other), cached.decide(REQUEST)]
        strip = lambda r: {**r, "usage": {k: v for k, v in r["usage"].items() if k != "cached_tokens"}}  # noqa: E731
        assert [json.dumps(strip(r)) for r in got] == [json.dumps(strip(r)) for r in expected + expected[:1]]
        usage = [r["usage"]["cached_tokens"] for r in got]
        assert usage[0] == 0 and usage[1] > 36 and usage[2] == got[2]["usage"]["input_tokens"]
        # The segmented schedule itself agrees with one whole decode to float rounding. With W4A4 the
        # activations are rounded to FP4 codes too: a float-rounding difference between the two
        # schedules can move one value across a code boundary (which one depends on the CPU's kernels),
        # and the linear-attention state carries that to every later token. There the decisions made on
        # the two agree within the scheme's decision gate instead.
        enc = cached.prepare(REQUEST).encoded
        whole = cached.tower.hidden_states(enc.ids)
        seg, _ = plain.tower.forward(enc.ids, enc.prefix_tokens, enc.state_tokens)
        if scheme == "nvfp4a16":
            assert float(np.abs(whole - seg).max()) < 1e-4
        else:
            apart = [np.abs(a - b).max() for a, b in zip(
                split_probabilities(head_logits(plain.head, plain.lexical, enc, whole)[0], enc.option_counts),
                split_probabilities(head_logits(plain.head, plain.lexical, enc, seg)[0], enc.option_counts))]
            assert float(max(apart)) < MAX_DP[scheme]


def test_the_tower_is_a_language_tower_and_runs_many_one_by_one(clef):
    from clef_gguf.tower.cache import StateCache
    from clef_gguf.tower.protocol import LanguageTower

    tower = clef.tower
    assert isinstance(tower, LanguageTower) and tower.pack_size(10) == 1
    encoded = [clef.prepare(r).encoded for r in (REQUEST, {**REQUEST, "questions": {"bug": {"type": "noul"}}})]
    prompts = [(e.ids, e.prefix_tokens, e.state_tokens) for e in encoded]
    prompts.insert(1, (np.array([1, 10**7], dtype=np.int32), 0, 0))  # outside the vocab
    tower._schedule.prefix = None  # both runs start from nothing kept
    want_cache = StateCache(64 << 20)
    want = [tower.forward(*p, want_cache) for p in (prompts[0], prompts[2])]
    tower._schedule.prefix = None
    got = tower.forward_many(prompts, StateCache(64 << 20), pack=1)
    assert isinstance(got[1], errors.InferenceError) and "outside the vocab" in got[1].message
    # the second prompt restores the first one's [prefix][state]
    assert [g[1] for g in (got[0], got[2])] == [w[1] for w in want] == [0, prompts[2][1] + prompts[2][2]]
    assert all(np.array_equal(g[0], w[0]) for g, w in zip((got[0], got[2]), want))
    with pytest.raises(errors.InvalidValue):
        tower.forward_many(prompts, None, pack=0)


def test_packed_prompts_agree_with_one_at_a_time(clef, scheme, monkeypatch):
    tower = clef.tower
    requests = [REQUEST, {**REQUEST, "questions": {"bug": {"type": "noul"}}}, SAMPLE_REQUESTS[0], *SAMPLE_REQUESTS[2:]]
    encoded = [clef.prepare(r).encoded for r in requests]
    prompts = [(e.ids, e.prefix_tokens, e.state_tokens) for e in encoded]
    prompts.insert(2, (np.array([1, 10**7], dtype=np.int32), 0, 0))  # outside the vocab: its error in place
    forwards: list[int] = []
    decode_many = tower._seqs.decode_many
    monkeypatch.setattr(tower._seqs, "decode_many", lambda ids: forwards.append(len(ids)) or decode_many(ids))
    want = tower.forward_many(prompts, None, pack=1)
    got = tower.forward_many(prompts, None, pack=3)
    assert forwards == [3, 2]  # five good prompts: one forward of three, one of two
    assert isinstance(got[2], errors.InferenceError) and isinstance(want[2], errors.InferenceError)
    good = [i for i in range(len(prompts)) if i != 2]
    worst = 0.0
    for enc, i in zip(encoded, good):
        assert got[i][1] == 0 and got[i][0].shape == want[i][0].shape
        diff = clef.flat_probabilities(enc, got[i][0]) - clef.flat_probabilities(enc, want[i][0])
        worst = max(worst, float(np.abs(diff).max()))
    # fp32: NVFP4A16's packed probabilities are one-at-a-time's to float rounding. W4A4 rounds the
    # activations to FP4 codes, where a rounding difference can cross a code boundary (see above).
    assert worst < (1e-5 if scheme == "nvfp4a16" else MAX_DP[scheme])


def test_packing_keeps_what_the_cache_serves(clef):
    from clef_gguf.tower.cache import StateCache

    tower = clef.tower
    requests = [REQUEST, {**REQUEST, "questions": {"bug": {"type": "noul"}}}, SAMPLE_REQUESTS[2], SAMPLE_REQUESTS[3]]
    prompts = [(e.ids, e.prefix_tokens, e.state_tokens) for e in (clef.prepare(r).encoded for r in requests)]
    cache = StateCache(64 << 20)
    tower.forward(*prompts[0], cache)  # keeps the first prompt and its [prefix][state]
    forwards: list[int] = []
    decode_many = tower._seqs.decode_many
    tower._seqs.decode_many = lambda ids: forwards.append(len(ids)) or decode_many(ids)
    try:
        got = tower.forward_many([prompts[0], prompts[1], prompts[2], prompts[3], prompts[2]], cache, pack=4)
    finally:
        del tower._seqs.decode_many
    assert forwards == [2]  # the two fresh prompts; the copy of one of them waits and hits the cache
    ids, prefix, state = prompts[1]
    assert [g[1] for g in got] == [len(prompts[0][0]), prefix + state, 0, 0, len(prompts[2][0])]
    assert np.array_equal(got[4][0], got[2][0])


def test_a_pack_the_device_cannot_hold_runs_one_at_a_time(clef, monkeypatch, caplog):
    tower = clef.tower
    prompts = [(e.ids, e.prefix_tokens, e.state_tokens) for e in (clef.prepare(r).encoded for r in SAMPLE_REQUESTS[:3])]
    want = tower.forward_many(prompts, None, pack=1)

    def out_of_memory(ids):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(tower._seqs, "decode_many", out_of_memory)
    with caplog.at_level("WARNING", logger="clef_gguf.tower.nvfp4"):
        got = tower.forward_many(prompts, None, pack=3)
    assert "3 prompts" in caplog.text and "one at a time" in caplog.text
    assert all(np.array_equal(g[0], w[0]) and g[1] == w[1] for g, w in zip(got, want))


def test_the_policy_packs_on_cuda_only_and_the_engine_follows_it(model_dir, monkeypatch):
    from clef_gguf.tower.nvfp4 import tower as nvfp4_tower

    assert nvfp4_tower.PACK["cpu"] == 1 and nvfp4_tower.PACK["cuda"] > 1
    groups = nvfp4_tower.packs([(i, np.zeros(n, np.int32)) for i, n in enumerate([900, 10, 5000, 20, 30])], 2)
    assert [[i for i, _ in g] for g in groups] == [[1, 3], [4, 0], [2]]  # by length, two at a time
    groups = nvfp4_tower.packs([(i, np.zeros(n, np.int32)) for i, n in enumerate([900, 10, 5000, 20, 30])], 8)
    assert [[i for i, _ in g] for g in groups] == [[1, 3, 4, 0], [2]]  # 5 x 5000 padded tokens: over PACK_TOKENS
    monkeypatch.setitem(nvfp4_tower.PACK, "cpu", 4)  # the CUDA policy, on the CPU
    requests = [REQUEST, SAMPLE_REQUESTS[0], *SAMPLE_REQUESTS[2:]]
    with Clef.load(model_dir, max_length=2048, threads=2, state_cache_mb=0) as clef:
        assert clef.tower.pack_size(100) == 4 and clef.tower.pack_size(nvfp4_tower.PACK_MAX_TOKENS + 1) == 1
        forwards: list[int] = []
        decode_many = clef.tower._seqs.decode_many
        monkeypatch.setattr(clef.tower._seqs, "decode_many", lambda ids: forwards.append(len(ids)) or decode_many(ids))
        packed = list(clef.decide_many(requests))
        one = list(clef.decide_many(requests, pack=1))
    assert forwards == [4]
    assert [list(r["answers"]) for r in packed] == [list(r["answers"]) for r in one]


def test_backend_flag_must_match_the_files(model_dir, tiny_model_dir):
    with pytest.raises(errors.InvalidSetting) as info:
        Clef.load(model_dir, backend="gguf")
    assert info.value.field == "backend" and "NVFP4" in info.value.message
    with pytest.raises(errors.InvalidSetting) as info:
        Clef.load(tiny_model_dir, backend="nvfp4")
    assert info.value.field == "backend" and "GGUF" in info.value.message
    with pytest.raises(errors.InvalidSetting) as info:
        Clef.load(model_dir, backend="fp8")
    assert info.value.field == "backend"
    with pytest.raises(errors.InvalidSetting) as info:
        Clef.load(model_dir, gpu_layers=3)
    assert info.value.field == "gpu_layers"


def _copy(model_dir, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(model_dir, out)
    return out


def test_damaged_checkpoints_are_clear_errors(model_dir, tmp_path):
    bad = _copy(model_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["format"] = "float-quantized"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.CorruptModel) as info:
        Clef.load(bad)
    assert info.value.field == "tower" and "nvfp4-pack-quantized" in info.value.message
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": 7}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.CorruptModel):
        Clef.load(bad)
    shutil.rmtree(bad)
    bad = _copy(model_dir, tmp_path)
    for shard in bad.glob("model*.safetensors"):
        shard.write_bytes(b"\x00" * 16)
    with pytest.raises(errors.CorruptModel):
        Clef.load(bad)


def test_a_missing_library_is_named(model_dir, monkeypatch):
    for name in ("compressed_tensors", "compressed_tensors.quantization"):  # None: an import fails
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(errors.MissingDependency) as info:
        Clef.load(model_dir)
    assert info.value.code == "missing_dependency" and info.value.field == "backend"
    assert info.value.message == ("the nvfp4 backend needs compressed-tensors: "
                                  "pip install 'clef-gguf[nvfp4]'")


def test_convert_then_decide_from_the_command_line(tiny_release, tmp_path, scheme):
    out = tmp_path / scheme
    run = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "convert", str(tiny_release), str(out),
                          "--outtype", scheme], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["backend"] == "nvfp4"
    (tmp_path / "req.json").write_text(json.dumps(REQUEST))
    run = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "decide", "--request", str(tmp_path / "req.json"),
                          "--model", str(out), "--backend", "nvfp4", "--threads", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["audit"]["backend"] == "torch-nvfp4"
    assert run.stderr.count("slow") == 1  # one warning line: this machine has no CUDA
    wrong = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "decide", "--request", str(tmp_path / "req.json"),
                            "--model", str(out), "--backend", "gguf"], capture_output=True, text=True,
                           timeout=600)
    assert wrong.returncode != 0 and '"field": "backend"' in wrong.stdout + wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_convert_refuses_llama_cpp_options_for_nvfp4(tiny_release, tmp_path):
    run = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "convert", str(tiny_release),
                          str(tmp_path / "x"), "--outtype", "nvfp4", "--imatrix", "uniform"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "--imatrix" in run.stdout + run.stderr
    assert not (tmp_path / "x").exists()


def test_the_server_answers_with_the_nvfp4_backend(model_dir, clef, tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "server"))
    from server_helpers import serve_process, wait_healthy

    with serve_process(tmp_path, "--model", str(model_dir), "--backend", "nvfp4", "--threads", "2",
                       "--max-length", "2048") as (proc, url, _port):
        wait_healthy(proc, url)
        got = httpx.post(f"{url}/v1/systemone", json=REQUEST, timeout=60)
        assert got.status_code == 200
        body = got.json()
        expected = clef.decide(REQUEST)
        assert body["answers"] == expected["answers"]
        assert body["audit"]["backend"] == "torch-nvfp4"
        assert httpx.post(f"{url}/v1/systemone", json={"state": "x"}, timeout=60).status_code == 422


def test_backend_flag_overrides_a_directory_holding_both(model_dir, tiny_model_dir, tmp_path):
    both = _copy(model_dir, tmp_path)
    for name in ("tower-f32.gguf", files.MANIFEST):  # the GGUF conversion of the same release
        shutil.copyfile(tiny_model_dir / name, both / name)
    with Clef.load(both, threads=2) as auto:
        assert auto.info["backend"] == "torch-nvfp4"
    with Clef.load(both, threads=2, backend="gguf") as gguf:
        assert gguf.info["backend"] == "llama-cpp-python"
        assert gguf.decide(REQUEST)["answers"]


def test_a_converted_checkpoint_is_not_hashed_again_at_load(model_dir):
    found = files.from_directory(model_dir)
    shards = sorted(model_dir.glob("model*.safetensors"))
    assert shards and all(found.known_sha256(s) == files.sha256_file(s) for s in shards)
    assert found.known_sha256(model_dir / files.CHECKPOINT_CONFIG) is not None


def test_weights_dequantized_once_at_load_give_the_same_bits_as_per_call(model_dir, monkeypatch, caplog):
    """Dense copies are kept when they fit half the device's free memory (chosen at load and logged),
    else each call dequantizes its layer: the same tensors either way, so the same hidden states."""
    import logging

    from clef_gguf.tower.nvfp4 import tower as nvfp4_tower

    ids = np.arange(300, 380, dtype=np.int32)
    with caplog.at_level(logging.INFO, logger="clef_gguf.tower.nvfp4"):
        with nvfp4_tower.NVFP4Tower.load(model_dir / files.CHECKPOINT_CONFIG, n_ctx=256, threads=2) as dense:
            once = dense.hidden_states(ids)
            assert dense.kernel.startswith("dense weights") and dense.model.quantized()[0].dense is not None
        monkeypatch.setattr(nvfp4_tower, "free_bytes", lambda device: 1024)  # a small GPU: per call
        with nvfp4_tower.NVFP4Tower.load(model_dir / files.CHECKPOINT_CONFIG, n_ctx=256, threads=2) as lean:
            each = lean.hidden_states(ids)
            assert lean.kernel.startswith("dequantizing fallback")
            assert "dense" not in lean.model.quantized()[0]._buffers
    assert torch.equal(torch.from_numpy(once), torch.from_numpy(each))
    said = [r.getMessage() for r in caplog.records if "nvfp4 weights" in r.getMessage()]
    assert said[0].startswith("nvfp4 weights dequantized once at load") and "at each call" in said[1]


def test_an_installed_fla_is_the_linear_attention_kernel_and_its_absence_is_said(model_dir, tmp_path):
    """Without flash-linear-attention, transformers runs its reference code, and the load says so once; with
    it (a stand-in here: pure PyTorch behind fla's names, no Triton), fla's functions run the layers, with
    the same answers."""
    from clef_gguf.tower.nvfp4 import linear_kernels

    request = tmp_path / "r.json"
    request.write_text(json.dumps(REQUEST))
    calls = tmp_path / "calls.txt"
    runs = {}
    for name, extra in (("reference", {}), ("fla", {"PYTHONPATH": str(STANDIN), "FLA_STANDIN_LOG": str(calls)})):
        env = {**os.environ, **extra}
        proc = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "-v", "decide", "--model", str(model_dir),
                               "--request", str(request)], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (json.loads(proc.stdout)["answers"], proc.stderr)
    assert "linear attention kernels: none fast; reference PyTorch for causal-conv1d, flash-linear-attention" \
        in runs["reference"][1]
    assert "linear attention kernels: fla fast; reference PyTorch for causal-conv1d" in runs["fla"][1]
    assert "chunk_gated_delta_rule" in calls.read_text()  # the stand-in ran the layers
    assert runs["fla"][0] == runs["reference"][0]
    assert set(linear_kernels.bound(__import__("transformers.models.qwen3_5.modeling_qwen3_5",
                                               fromlist=["x"])).values()) == {linear_kernels.REFERENCE}

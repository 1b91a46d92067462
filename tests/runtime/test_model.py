"""The whole pipeline through ``Clef`` on the tiny converted model, and its load-time failures."""

import json
import shutil

import numpy as np
import pytest
import torch

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.core.limits import GiB
from clef_gguf.formats import files
from clef_gguf.formats.files import MANIFEST, from_directory

REQUEST = {
    "model": "tiny",
    "state": {"ticket": "Refund not received after 14 days", "amount": 129.5},
    "questions": {
        "urgent": {"type": "noul", "instructions": "Is this urgent?"},
        "team": {"type": "choice", "instructions": "Which team?",
                 "criteria": {"billing": "Payments and refunds", "tech": None, "sales": "New deals"}},
        "anger": {"type": "score", "instructions": "How angry is the customer?",
                  "criteria": ["calm", "annoyed", "furious"]},
    },
}


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as model:
        yield model


def same(response: dict) -> dict:
    """All but ``usage.cached_tokens``, which depends on what the state cache held."""
    return {**response, "usage": {k: v for k, v in response["usage"].items()
                                  if k != "cached_tokens"}}


def test_decide_answers_every_question(clef):
    out = clef.decide(REQUEST)
    assert out["model"] == "tiny"
    assert list(out["answers"]) == ["urgent", "team", "anger"]
    urgent, team, anger = out["answers"].values()
    assert urgent["type"] == "noul" and 0 <= urgent["noul"] <= 1
    assert list(team["probabilities"]) == ["billing", "tech", "sales"]
    assert abs(sum(team["probabilities"].values()) - 1) < 2e-4
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert 0 <= anger["score"] <= 2 and list(anger["legend"]) == ["0", "1", "2"]
    assert out["usage"]["output_tokens"] == 0 and out["usage"]["input_tokens"] > 50
    audit = out["audit"]
    assert audit["backend"] == "llama-cpp-python" and audit["precision"] == "f32"
    assert audit["model_hash"] == files.sha256_file(clef.files.tower)  # the bytes, not the manifest
    assert audit["input_tokens"] == [out["usage"]["input_tokens"]]


def test_same_request_same_bytes(clef):
    a = json.dumps(clef.decide(REQUEST))
    b = json.dumps(clef.decide(json.loads(json.dumps(REQUEST))))
    assert a == b


def test_timings_cover_every_stage(clef):
    prepared = clef.prepare(REQUEST)
    _, timings = clef.run(prepared)
    stages = ("encode", "tower", "lexical", "head", "answer")
    assert set(timings) == {*stages, "total", "tokens"}
    assert timings["tokens"] == prepared.encoded.n_tokens
    assert timings["tower"] > 0 and timings["head"] > 0  # each stage is really timed
    # the stages add up to the total: nothing is counted twice or left out
    assert abs(sum(timings[s] for s in stages) - timings["total"]) < 0.05


def test_probabilities_match_rounded_answers(clef):
    probs = clef.probabilities(REQUEST)
    out = clef.decide(REQUEST)
    assert out["answers"]["urgent"]["noul"] == round(float(probs[0][0]), 4)
    assert [len(p) for p in probs] == [2, 3, 3]


def test_model_hash_describes_the_file_that_ran(tiny_model_dir, tiny_model_dir_factory, tmp_path,
                                               monkeypatch):
    manifest_hash = from_directory(tiny_model_dir).sha256["tower-f32.gguf"]
    real = files.sha256_file

    def no_rehash(path, *a, **k):
        raise AssertionError(f"an unchanged, recorded file was hashed again: {path}")

    monkeypatch.setattr(files, "sha256_file", no_rehash)
    with Clef.load(tiny_model_dir) as clef:  # unchanged: the manifest's hash, no re-hash
        assert clef.provenance.model_hash == manifest_hash
    monkeypatch.setattr(files, "sha256_file", real)
    # --gguf pointing at another file of the same name: that file's hash
    other = tmp_path / "elsewhere" / "tower-f32.gguf"
    other.parent.mkdir()
    shutil.copyfile(tiny_model_dir_factory("f16") / "tower-f16.gguf", other)
    with Clef.load(tiny_model_dir, gguf=other) as clef:
        assert clef.provenance.model_hash == real(other) != manifest_hash
    # the directory's tower edited after the manifest was written: re-hashed
    copy = tmp_path / "edited"
    shutil.copytree(tiny_model_dir, copy)
    tower = copy / "tower-f32.gguf"
    data = bytearray(tower.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor's data
    tower.write_bytes(bytes(data))
    with Clef.load(copy) as clef:
        assert clef.provenance.model_hash == real(tower) != manifest_hash
        assert clef.info["files"]["tower-f32.gguf"] == real(tower)


def test_requests_the_reference_answers_are_answered_with_warnings(clef):
    body = {"state": "Refund not received", "id": "rec-9", "images": [], "videos": [],
            "questions": {"q": {"type": "noul", "instructions": 7, "criteria": {"maybe": "?"}},
                          "one": {"type": "choice", "criteria": {"only": "the one option"}}}}
    out = clef.decide(body)
    assert [w["field"] for w in out["warnings"]] == ["id", "questions.q.criteria.maybe"]
    assert out["answers"]["one"] == {"type": "choice", "choice": "only", "confidence": 1.0,
                                     "probabilities": {"only": 1.0}}
    # the ignored keys change nothing: the same answers as without them
    clean = {"state": body["state"], "questions": {"q": {"type": "noul", "instructions": 7},
                                                   "one": body["questions"]["one"]}}
    assert same(clef.decide(clean)) == same({k: v for k, v in out.items() if k != "warnings"})
    with pytest.raises(errors.UnknownField):
        clef.decide(body, strict=True)


def test_invalid_request_is_refused_before_compute(clef):
    with pytest.raises(errors.TooFewOptions):
        clef.prepare({"state": "x", "questions": {"c": {"type": "choice", "criteria": {"a": 1}}}},
                     strict=True)
    with pytest.raises(errors.InvalidMedia) as exc:  # "a" is base64 (of no picture), not a file name
        clef.decide({"state": "x", "images": ["a"], "questions": {"q": {"type": "noul"}}})
    assert exc.value.field == "images.0"


def test_too_long_refused_or_truncated(clef):
    long = {"state": "refund " * 3000, "questions": {"q": {"type": "noul"}}}
    with pytest.raises(errors.ContextTooLarge):
        clef.decide(long)
    out = clef.decide(long, truncate_state=True)
    assert out["truncated"] is True and out["usage"]["input_tokens"] == 2048
    again = clef.decide({**long, "options": {"truncate_state": True}})
    assert same(again) == same(out) and again["usage"]["cached_tokens"] == 2048  # the same prompt


def test_bf16_head_runs_close_to_fp32(tiny_model_dir, clef):
    with Clef.load(tiny_model_dir, max_length=2048, head_dtype="bf16") as b:
        pb = b.probabilities(REQUEST)
    p32 = clef.probabilities(REQUEST)
    assert max(np.abs(a - c).max() for a, c in zip(pb, p32)) < 0.05


def copy_model(src, dst):
    shutil.copytree(src, dst)
    (dst / MANIFEST).unlink()  # edited files would no longer match the manifest's hashes
    return dst


def test_truncated_gguf_is_a_clear_error(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    gguf = next(d.glob("*.gguf"))
    gguf.write_bytes(gguf.read_bytes()[:-1000])
    with pytest.raises(errors.CorruptModel) as info:
        Clef.load(d)
    assert gguf.name in info.value.message


def test_missing_head_file(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    (d / "joint_head.safetensors").unlink()
    with pytest.raises(errors.ModelNotFound) as info:
        Clef.load(d)
    assert info.value.field == "head_weights"


def test_missing_model_directory(tmp_path):
    with pytest.raises(errors.ModelNotFound):
        Clef.load(tmp_path / "nothing-here")


def test_head_hidden_size_must_match_the_tower(tiny_model_dir, tmp_path):
    from clef_gguf.convert.synthetic.head import random_head
    from clef_gguf.heads import save_head

    d = copy_model(tiny_model_dir, tmp_path / "m")
    config = json.loads((d / "joint_head_config.json").read_text())
    config["hidden_size"] *= 2
    save_head(random_head(config, seed=1), d, dtype=torch.bfloat16)
    with pytest.raises(errors.HeadMismatch) as info:
        Clef.load(d)
    assert str(config["hidden_size"]) in info.value.message


def test_tower_with_another_architecture_is_refused(tiny_model_dir, tmp_path):
    import gguf

    d = copy_model(tiny_model_dir, tmp_path / "m")
    for p in d.glob("*.gguf"):
        p.unlink()
    w = gguf.GGUFWriter(str(d / "clef.gguf"), "clef")
    w.add_tensor("output.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(errors.CorruptModel, match="convert split"):
        Clef.load(d)


def test_unknown_precision(tiny_model_dir):
    with pytest.raises(errors.InvalidSetting):
        Clef.load(tiny_model_dir, precision="fp8")


def test_the_head_dtype_has_its_own_name_and_the_old_one_still_works(tiny_model_dir):
    with pytest.raises(errors.InvalidSetting) as info:
        Clef.load(tiny_model_dir, head_dtype="fp8")
    assert info.value.field == "head_dtype"
    with Clef.load(tiny_model_dir, max_length=512, precision="bf16") as clef:
        assert clef.info["head_dtype"] == "bf16" and clef.head_dtype == torch.bfloat16
        assert clef.info["precision"] == clef.info["quant"]  # the tower's format, as in the audit


def test_a_mistyped_directory_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errors.ModelNotFound) as info:
        Clef.load("demo-modle")
    assert "neither a model directory" in info.value.message


def test_gpu_layers_on_a_cpu_only_build(tiny_model_dir):
    from clef_gguf.runtime import backends

    for asked in ("auto", "all", 0, 3):
        with Clef.load(tiny_model_dir, gpu_layers=asked, state_cache_mb=0) as clef:
            assert clef.info["gpu_layers"] == 0  # this build has no GPU backend: it runs on the CPU
            assert clef.decide(REQUEST)["answers"]
    with pytest.raises(errors.InvalidSetting) as info:
        Clef.load(tiny_model_dir, gpu_layers=-2)
    assert info.value.field == "gpu_layers"
    assert backends.gpu_layers("all", tiny_model_dir / "tower-f32.gguf", 64, 16384) == -1


def test_auto_gpu_layers_follow_the_device_policy(tiny_model_dir, monkeypatch):
    from clef_gguf.runtime import backends
    from clef_gguf.tower import llama_tower as tower
    from clef_gguf.models import machine

    box = machine.DeviceProfile(64 << 30, 50 << 30, 16, "x86_64", frozenset({"avx2"}),
                                (machine.GPU(0, "RTX 4090", 24 << 30, 23 << 30),), True)
    monkeypatch.setattr(tower, "gpu_offload", lambda: True)
    monkeypatch.setattr(machine, "probe", lambda **_: box)
    path = tiny_model_dir / "tower-f32.gguf"
    assert backends.gpu_layers("auto", path, 64, 16384) == -1
    small = machine.DeviceProfile(**{**box.__dict__, "gpus": (machine.GPU(0, "tiny", GiB, GiB // 2),)})
    monkeypatch.setattr(machine, "probe", lambda **_: small)
    assert backends.gpu_layers("auto", path, 64, 16384) == 0  # KV for 16k tokens does not fit
    monkeypatch.setattr(tower, "gpu_offload", lambda: False)
    assert backends.gpu_layers("auto", path, 64, 16384) == 0


def test_head_threads_default_to_the_towers(tiny_model_dir):
    with Clef.load(tiny_model_dir, threads=1) as clef:
        assert clef.info["head_threads"] == torch.get_num_threads() == 1
    with Clef.load(tiny_model_dir, threads=1, head_threads=2) as clef:
        assert clef.info["head_threads"] == 2
    with pytest.raises(errors.InvalidSetting):
        Clef.load(tiny_model_dir, head_threads=0)


# ---------------------------------------------------------------- several prompts per decode
def packed_requests() -> list:
    """Mixed lengths, three question sets about one state, a repeat and an invalid request."""
    long_state = {"ticket": "The invoice was charged twice. " * 40, "amount": 129.5}
    questions = [{"urgent": REQUEST["questions"]["urgent"]}, {"team": REQUEST["questions"]["team"]},
                 REQUEST["questions"]]
    reqs = [{"state": f"Refund {i} not received", "questions": REQUEST["questions"]} for i in range(5)]
    reqs += [{"state": long_state, "questions": q} for q in questions]
    reqs += [REQUEST, {"state": "x", "questions": {"c": {"type": "choice", "criteria": {}}}}, REQUEST]
    return reqs


def test_decide_many_packed_equals_one_by_one(tiny_model_dir):
    """Byte-identical responses (usage.cached_tokens included) from two fresh models, one decoding
    one prompt at a time and one four per llama_decode; the unrounded probabilities are equal too."""
    reqs = packed_requests()
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as one, \
            Clef.load(tiny_model_dir, max_length=2048, threads=2) as packed:
        want = list(one.decide_many(reqs, pack=1))
        got = list(packed.decide_many(reqs, pack=4))
        assert json.dumps(got) == json.dumps(want)
        assert max(packed.tower.pack_stats) > 1 and not one.tower.pack_stats
        assert got[-2]["error"]["code"] == "invalid_criteria" and "answers" in got[-1]
        valid = [r for r in reqs if "c" not in r["questions"]]
        prepared = [packed.prepare(r) for r in valid]
        hidden = packed.tower.forward_many([(p.encoded.ids, p.encoded.prefix_tokens, p.encoded.state_tokens)
                                            for p in prepared], None, pack=4)
        for r, p, (h, _) in zip(valid, prepared, hidden):
            probs = answer_probs(packed, p, h)
            assert all(np.array_equal(a, b) for a, b in zip(probs, one.probabilities(r)))


def answer_probs(clef, prepared, hidden):
    from clef_gguf.pipeline import answer
    from clef_gguf.runtime.stages import head_logits

    logits = head_logits(clef.head, clef.lexical, prepared.encoded, hidden)[0]
    return answer.split_probabilities(logits, prepared.encoded.option_counts)


def test_run_many_matches_run_and_the_policy_packs_on_the_cpu(clef):
    from clef_gguf.tower.llama_tower import PACKING

    prepared = [clef.prepare({"state": f"Refund {i} late", "questions": REQUEST["questions"]})
                for i in range(6)]
    clef.tower.pack_stats.clear()
    packed = clef.run_many(prepared)  # pack=None: the tower's policy
    assert 1 < max(clef.tower.pack_stats) <= PACKING["cpu"].pack
    for p, (response, timings) in zip(prepared, packed):
        ref, ref_timings = clef.run(p)
        assert same(response) == same(ref) and set(timings) == set(ref_timings)
    assert [r[0] for r in clef.run_many(prepared, pack=1)] == [clef.run(p)[0] for p in prepared]
    with pytest.raises(errors.InvalidValue):
        clef.run_many(prepared, pack=0)
    with pytest.raises(errors.InvalidValue):
        clef.run_many(prepared, pack=0)
    with pytest.raises(errors.InvalidValue):
        list(clef.decide_many([REQUEST], pack=True))


def test_a_pictures_vision_time_is_part_of_the_towers(clef, tmp_path):
    """With a picture, ``vision`` is the part of ``tower`` spent in the vision tower: timed on the first
    run, 0 when the state cache already held the prompt (its picture never re-encoded)."""
    import base64
    import io

    import PIL.Image

    buffer = io.BytesIO()
    PIL.Image.new("RGB", (32, 32), (200, 30, 90)).save(buffer, "PNG")
    request = {**REQUEST, "images": ["data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()]}
    _, timings = clef.run(clef.prepare(request))
    assert 0 < timings["vision"] <= timings["tower"]
    assert abs(sum(timings[s] for s in ("encode", "tower", "lexical", "head", "answer")) - timings["total"]) < 0.05
    _, again = clef.run(clef.prepare(request))
    assert again["vision"] <= timings["vision"]

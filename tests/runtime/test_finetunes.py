"""Fine-tunes on one loaded tower (``clef_gguf.runtime.finetunes`` and ``Clef.load(adapters=)``): the flags,
routing by a request's ``model``, cache keys per adapter, packing per model, and every refusal.

The fine-tunes are random ones (``convert.synthetic.finetune_demo``) converted by ``convert adapter``; their
parity with the PEFT-merged reference is tests/runtime/test_finetune.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from clef_gguf.core import errors
from clef_gguf.runtime.finetunes import cache_tag, named
from clef_gguf.runtime.settings import parse_adapter_flags as parse_flags
from clef_gguf.runtime.model import Clef

REQUEST = {"state": "The app crashes when I upload a photo. Third time today!",
           "questions": {"bug": {"type": "noul"},
                         "team": {"type": "choice", "criteria": {"mobile": None, "web": None, "infra": None}}}}
OTHER = dict(REQUEST, questions={"calm": {"type": "score", "criteria": ["calm", "annoyed", "angry"]}})


@pytest.fixture(scope="module")
def tunes(tiny_fine_tunes) -> dict[str, Path]:
    return tiny_fine_tunes


@pytest.fixture(scope="module")
def served(tiny_model_dir, tunes):
    with Clef.load(tiny_model_dir, adapters=tunes) as clef:
        yield clef


def _answers(response: dict) -> dict:
    return response["answers"]


# ------------------------------------------------------------------ flags
def test_flags_one_bare_directory_or_names():
    assert parse_flags(None) is None
    assert parse_flags(["/x"]) == "/x"
    assert parse_flags(["a=/x", "b=/y"]) == {"a": "/x", "b": "/y"}
    assert parse_flags(["a=/x"]) == {"a": "/x"}


@pytest.mark.parametrize("flags", [["/x", "/y"], ["a=/x", "a=/y"], ["=/x", "b=/y"], ["a=", "b=/y"]])
def test_flags_refused(flags):
    with pytest.raises(errors.InvalidSetting) as exc:
        parse_flags(flags)
    assert exc.value.field == "adapter"


@pytest.mark.parametrize("adapters", [{"": "/x"}, {"a=b": "/x"}, {3: "/x"}, ["/x"]])
def test_named_refuses_bad_names(adapters):
    with pytest.raises(errors.InvalidSetting):
        named(adapters)


def test_cache_tags_differ_by_adapter_and_scale():
    assert cache_tag("ab" * 32, 1.0) != cache_tag("cd" * 32, 1.0)
    assert cache_tag("ab" * 32, 1.0) != cache_tag("ab" * 32, 0.5)


# ------------------------------------------------------------------ routing
def test_models_and_default(served, tiny_model_dir):
    base_name = served.provenance.model_name
    assert set(served.models) == {base_name, "a", "b"}
    assert served.default == base_name and served.base is served.models[base_name]
    # One tower: every fine-tune is a view of the base's model.
    assert all(m.tower._model is served.base.tower._model for m in served.models.values())
    assert served.models["a"].tower.adapter_path is not None and served.base.tower.adapter_path is None


def test_each_model_answers_its_own(served, tiny_model_dir, tunes):
    base = served.decide(REQUEST)
    a, b = served.decide(dict(REQUEST, model="a")), served.decide(dict(REQUEST, model="b"))
    assert _answers(a) != _answers(base) and _answers(b) != _answers(a)
    assert a["model"] == "a" and a["audit"]["fine_tune"]["name"] == "a"
    assert "fine_tune" not in base["audit"]  # the base's answer is what it was before fine-tunes
    assert a["audit"]["model_hash"] != base["audit"]["model_hash"] != b["audit"]["model_hash"]
    with Clef.load(tiny_model_dir) as alone:  # the base's whole response, as without fine-tunes
        assert {**alone.decide(REQUEST), "usage": None} == {**base, "usage": None}
    with Clef.load(tiny_model_dir, adapters=tunes["a"]) as only_a:
        assert only_a.provenance.model_name == "a" and only_a.default == "a"
        assert _answers(only_a.decide(REQUEST)) == _answers(a)  # a bare directory answers by default
        assert _answers(only_a.decide(dict(REQUEST, model=served.provenance.model_name))) == _answers(base)


def test_a_held_fine_tune_answers_as_itself_on_every_call(served):
    a = served.models["a"]
    routed = served.decide(dict(REQUEST, model="a"))
    assert _answers(a.decide(REQUEST)) == _answers(routed) != _answers(served.decide(REQUEST))
    assert a.decide(REQUEST)["audit"]["model_hash"] == routed["audit"]["model_hash"]
    assert [_answers(r) for r in a.decide_many([REQUEST, OTHER])] == \
        [_answers(r) for r in served.decide_many([dict(REQUEST, model="a"), dict(OTHER, model="a")])]
    held, via = a.probabilities(REQUEST), served.probabilities(dict(REQUEST, model="a"))
    assert all((x == y).all() for x, y in zip(held, via))
    base = served.models[served.default]
    enc = a.prepare(REQUEST).encoded
    assert not (a.logits(enc) == base.logits(enc)).all()  # its own head and adapter, not the base's
    # A held model answers as itself whatever the request's "model" says: it never routes.
    assert _answers(a.decide(dict(REQUEST, model="b"))) == _answers(routed)


def test_another_model_name_is_answered_by_the_default_with_a_warning(served):
    for name in ("nope", "clef-flash", "@cf/cloudflare/clef-flash", "clef"):  # what clients send
        got = served.decide(dict(REQUEST, model=name))
        assert _answers(got) == _answers(served.decide(REQUEST)) and got["model"] == name  # echoed
        (warning,) = [w for w in got["warnings"] if w["code"] == "unknown_model"]
        assert warning["field"] == "model" and name in warning["message"] and "a, b" in warning["message"]
    out = list(served.decide_many([dict(REQUEST, model="nope"), dict(REQUEST, model="a")]))
    assert "answers" in out[0] and out[0]["warnings"][0]["code"] == "unknown_model"
    assert _answers(out[1]) == _answers(served.decide(dict(REQUEST, model="a")))


def test_under_strict_another_model_name_is_refused(served, tiny_model_dir, tunes):
    with pytest.raises(errors.UnknownModel) as exc:
        served.prepare(dict(REQUEST, model="nope"), strict=True)
    assert exc.value.field == "model" and exc.value.status == 404 and "a, b" in exc.value.message
    with Clef.load(tiny_model_dir, adapters=tunes, strict=True) as strict:
        out = list(strict.decide_many([dict(REQUEST, model="nope"), dict(REQUEST, model="a")]))
        assert out[0]["error"]["code"] == "unknown_model" and "answers" in out[1]


def test_one_bare_fine_tune_answers_the_names_clients_send(tiny_model_dir, tunes, served):
    with Clef.load(tiny_model_dir, adapters=tunes["a"]) as only_a:
        want = _answers(served.decide(dict(REQUEST, model="a")))
        for name in (None, "clef-flash", "clef", "@cf/cloudflare/clef-flash"):
            got = only_a.decide(dict(REQUEST, **({"model": name} if name else {})))
            assert _answers(got) == want  # the fine-tune is the default: it answers them all


def test_the_family_name_is_an_alias_of_the_base(served):
    import dataclasses

    from clef_gguf.runtime.registry import Models

    base = served.base
    named = dataclasses.replace(base, provenance=dataclasses.replace(base.provenance,
                                                                     model_name="clef-flash:Q8_0@test"))
    models = Models(named, {"a": served.models["a"]})
    got = models.decide(dict(REQUEST, model="clef-flash"))
    assert "warnings" not in got and _answers(got) == _answers(served.decide(REQUEST))
    assert "warnings" in models.decide(dict(REQUEST, model="clef"))  # another family: not this model
    # The family name means the default model: a bare --adapter's fine-tune when it is the default.
    tuned = Models(named, {"a": served.models["a"]}, default="a")
    got = tuned.decide(dict(REQUEST, model="clef-flash"))
    assert "warnings" not in got and _answers(got) == _answers(served.decide(dict(REQUEST, model="a")))


def test_one_model_answers_any_name_unless_strict(served):
    from clef_gguf.runtime.registry import Models

    alone = Models(served.base)
    got = alone.decide(dict(REQUEST, model="@cf/cloudflare/clef-flash"))
    assert got["model"] == "@cf/cloudflare/clef-flash" and "warnings" not in got  # as the reference
    assert _answers(got) == _answers(served.decide(REQUEST))
    strict = Models(served.base, strict=True)  # what --strict's help promises, with one model too
    with pytest.raises(errors.UnknownModel) as exc:
        strict.decide(dict(REQUEST, model="@cf/cloudflare/clef-flash"))
    assert exc.value.field == "model" and served.base.name in exc.value.message
    assert _answers(strict.decide(dict(REQUEST, model=served.base.name))) == _answers(served.decide(REQUEST))
    import dataclasses

    assert Models.of(dataclasses.replace(served.base, strict=True)).strict  # a strict Clef's set is strict


def test_without_fine_tunes_any_model_name_is_echoed(tiny_model_dir):
    with Clef.load(tiny_model_dir, state_cache_mb=0) as clef:
        assert clef.decide(dict(REQUEST, model="@cf/anything"))["model"] == "@cf/anything"


def test_interleaved_and_packed_answers_equal_one_by_one(served):
    order = ["a", "b", None, "b", "a", None, "a"]
    requests = [dict(REQUEST if i % 2 else OTHER, **({"model": m} if m else {})) for i, m in enumerate(order)]
    served.state_cache.clear()
    one_by_one = [_answers(served.decide(r)) for r in requests]
    for pack in (None, 4):
        served.state_cache.clear()
        assert [_answers(r) for r in served.decide_many(requests, pack=pack)] == one_by_one


def test_a_state_is_never_shared_across_fine_tunes(served):
    prefix = served.prepare(REQUEST).encoded.prefix_tokens  # each model keeps its own decoded prefix
    for name in ("a", "b", None):  # every model has decoded its prefix once
        served.decide(dict(OTHER, state="warm up", **({"model": name} if name else {})))
    served.state_cache.clear()
    first = served.decide(dict(REQUEST, model="a"))
    assert first["usage"]["cached_tokens"] == prefix
    # The same state and questions through b and the base: decoded again, not restored from a's.
    assert served.decide(dict(REQUEST, model="b"))["usage"]["cached_tokens"] == prefix
    assert served.decide(REQUEST)["usage"]["cached_tokens"] == prefix
    again = served.decide(dict(REQUEST, model="a"))
    assert again["usage"]["cached_tokens"] == again["usage"]["input_tokens"]  # a's own prompt entry
    assert _answers(again) == _answers(first)
    # Another question set about the same state restores a's state, not b's.
    other_a = served.decide(dict(OTHER, model="a"))
    assert prefix < other_a["usage"]["cached_tokens"] < other_a["usage"]["input_tokens"]
    served.state_cache.clear()
    assert _answers(served.decide(dict(OTHER, model="a"))) == _answers(other_a)


# ------------------------------------------------------------------ refusals
def test_a_fine_tune_of_another_size_is_refused(tiny_model_dir, tmp_path):
    from clef_gguf.convert.synthetic.finetune_demo import build_finetune_checkpoint
    from clef_gguf.convert.lora import convert_adapter
    from clef_gguf.convert.release import convert_release
    from clef_gguf.convert.synthetic.tiny import build_release

    release = build_release(tmp_path / "rel256", preset="tiny256")
    other = convert_release(release, tmp_path / "m256", outtype="f32", name="m256")
    tune = convert_adapter(build_finetune_checkpoint(release, tmp_path / "ck"), tmp_path / "t256", base=other,
                           outtype="f32", name="t256")
    with pytest.raises(errors.AdapterMismatch) as exc:
        Clef.load(tiny_model_dir, adapters=tune)
    assert exc.value.field == "adapter" and "n_embd" in exc.value.message


def test_a_name_taken_by_the_base_is_refused(tiny_model_dir, tunes, served):
    with pytest.raises(errors.InvalidSetting):
        Clef.load(tiny_model_dir, adapters={served.provenance.model_name: tunes["a"]})


def test_a_missing_fine_tune_directory_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(errors.ModelNotFound) as exc:
        Clef.load(tiny_model_dir, adapters=tmp_path / "nothing")
    assert exc.value.field == "adapter"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_a_damaged_adapter_file_is_refused(tiny_model_dir, tunes, tmp_path, damage):
    tune = Path(shutil.copytree(tunes["a"], tmp_path / "t"))
    adapter = next(tune.glob("adapter-*.gguf"))
    data = adapter.read_bytes()
    if damage == "truncate":
        adapter.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        adapter.write_bytes(b"\x00" * len(data))
    else:  # a readable GGUF that is not an adapter: the base tower itself
        shutil.copy(next(Path(tiny_model_dir).glob("tower-*.gguf")), adapter)
    with pytest.raises((errors.CorruptModel, errors.AdapterMismatch)) as exc:
        Clef.load(tiny_model_dir, adapters=tune)
    assert exc.value.field == "adapter"


def test_a_head_of_the_wrong_shape_is_refused(tiny_model_dir, tunes, tmp_path):
    from safetensors.torch import load_file, save_file

    tune = Path(shutil.copytree(tunes["a"], tmp_path / "t"))
    head = load_file(str(tune / "joint_head.safetensors"))
    name = next(k for k, v in head.items() if v.ndim == 2)
    head[name] = head[name][:, :-1].contiguous()
    save_file(head, str(tune / "joint_head.safetensors"))
    with pytest.raises(errors.HeadMismatch):
        Clef.load(tiny_model_dir, adapters=tune)


def test_fine_tunes_need_the_gguf_backend(tiny_nvfp4_dir, tunes):
    with pytest.raises(errors.InvalidSetting) as exc:
        Clef.load(tiny_nvfp4_dir("nvfp4a16"), adapters=tunes["a"])
    assert exc.value.field == "adapter"

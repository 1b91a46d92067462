"""Running many requests (``clef_gguf.runtime.engine``): input order, each failure in its own place, the
state order, the groups a packing model runs, stopping between groups; on fake models, and once
through a real ``Clef`` on the tiny model."""

import logging

from clef_gguf import Clef
from clef_gguf.runtime import engine
from engine_helpers import OneByOne, Packing, requests


def test_answers_in_input_order_with_each_failure_in_its_place():
    model = OneByOne()
    reqs = requests("b", "refuse", "a", "crash", "b", "boom", "a")
    got = engine.answer(model, reqs)
    assert [g.get("answers") for g in got] == ["b-0", None, "a-2", None, "b-4", None, "a-6"]
    assert got[1] == {"error": {"code": "invalid_value", "message": "refused", "field": "state"}}
    assert got[3] == {"error": {"code": "internal_error", "field": None,
                                "message": "ValueError: tokenizer exploded"}}
    assert got[5] == {"error": {"code": "internal_error", "field": None,
                                "message": "RuntimeError: tower exploded"}}
    # by [prefix][state], input order within one state: each state's requests one after another
    assert model.ran == ["a-2", "a-6", "b-0", "b-4", "boom-5"]


def test_a_packed_run_that_fails_runs_its_requests_one_at_a_time(caplog):
    model = Packing(pack=4)
    reqs = requests("x", "boom", "y")
    with caplog.at_level(logging.ERROR, logger="clef_gguf.runtime.engine"):
        got = engine.answer(model, reqs)
    assert model.groups == [["boom-1", "x-0", "y-2"]]  # one packed run, then one by one
    assert model.ran == ["boom-1", "x-0", "y-2"]
    assert got[0] == {"answers": "x-0"} and got[2] == {"answers": "y-2"}
    assert got[1]["error"]["message"] == "RuntimeError: tower exploded"
    assert "running them one at a time" in caplog.text


def test_without_stop_everything_is_one_packed_run():
    model = Packing(pack=2)
    prepared = [model.prepare(r) for r in requests(*"edcba")]
    outcomes = engine.run(model, prepared)
    assert model.groups == [["a-4", "b-3", "c-2", "d-1", "e-0"]]
    assert [o[0]["answers"] for o in outcomes] == [r.request["id"] for r in prepared]


def test_stop_is_asked_before_each_group_of_what_the_tower_packs():
    model = Packing(pack=2)
    prepared = [model.prepare(r) for r in requests(*"edcba")]
    asked = []

    def stop() -> bool:
        asked.append(len(model.groups))
        return len(model.groups) == 2

    outcomes = engine.run(model, prepared, stop=stop)
    assert asked == [0, 1, 2]
    assert model.groups == [["a-4", "b-3"], ["c-2", "d-1"]]
    assert outcomes[0] is None  # "e" was left unrun
    assert [o[0]["answers"] for o in outcomes[1:]] == ["d-1", "c-2", "b-3", "a-4"]
    # an explicit pack sizes the groups; a group of one runs without run_many
    model = Packing(pack=4)
    engine.run(model, prepared[:3], pack=2, stop=lambda: False)
    assert model.groups == [["c-2", "d-1"]] and model.ran == ["c-2", "d-1", "e-0"]


def test_pack_one_and_models_that_do_not_pack_run_one_by_one():
    model = Packing(pack=4)
    prepared = [model.prepare(r) for r in requests("a", "b")]
    engine.run(model, prepared, pack=1)
    assert model.groups == [] and model.ran == ["a-0", "b-1"]
    assert engine.pack_size(model, prepared[0]) == 4
    assert engine.pack_size(OneByOne(), prepared[0]) == 1
    assert not isinstance(OneByOne(), engine.PackingModel)


def test_windows_are_read_lazily():
    taken = []

    def items():
        for i in range(5):
            taken.append(i)
            yield i

    chunks = engine.windows(items(), 2)
    assert next(chunks) == [0, 1] and taken == [0, 1]
    assert list(chunks) == [[2, 3], [4]]


def test_a_fault_in_one_request_of_a_window_leaves_the_others_answered(tiny_model_dir,
                                                                      monkeypatch):
    """A real Clef: a bug (not a ClefError) after the tower, hit by one request of a packed run."""
    reqs = [{"state": f"Refund {i} not received", "questions": {"u": {"type": "noul"}}}
            for i in range(4)]
    with Clef.load(tiny_model_dir, max_length=2048, threads=2) as clef:
        assert isinstance(clef, engine.PackingModel)
        want = [clef.decide(r)["answers"] for r in reqs]
        real = clef._answer

        def answer(prepared, *args):
            if prepared.request.state == reqs[2]["state"]:
                raise KeyError("head exploded")
            return real(prepared, *args)

        monkeypatch.setattr(clef, "_answer", answer)
        got = list(clef.decide_many(reqs))
    assert got[2] == {"error": {"code": "internal_error", "field": None,
                                "message": "KeyError: 'head exploded'"}}
    assert [g["answers"] for i, g in enumerate(got) if i != 2] == want[:2] + want[3:]

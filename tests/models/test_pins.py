"""The seed GGUF set (a repo that publishes no revision) against a fake Hub: every file pulls by
name, the first pull pins main's commit and each file's sha256, a later pull that finds main moved
or a file changed is refused until ``--update``, and ``resolve`` keeps using the pin."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from importlib import resources

import pytest

from _fakehub import FakeHub, point_at, sha256
from clef_gguf import cli
from clef_gguf.core.errors import ModelLoadError, PinMismatch
from clef_gguf.models import hub, listing
from clef_gguf.pick import catalog_commands as commands
from clef_gguf.models.catalog import CATALOG_ENV, Catalog
from clef_gguf.models.pins import pin, pins_path, record_pin

SEED_REPO, HEAD_REPO = "NANI-Nithin/clef-flash-GGUF", "Cloudflare/clef-flash"
C1, C2, HEAD_REV = "1" * 40, "2" * 40, "f" * 40
HEAD = {
    "joint_head.safetensors": os.urandom(4_000),
    "joint_head_config.json": b'{"hidden_size": 64}',
    "tokenizer.json": b'{"model": {}}',
}


def packaged() -> dict:
    return json.loads(resources.files("clef_gguf.models").joinpath("catalog.json").read_text())


def seed_files(tag: bytes) -> dict[str, bytes]:
    """Small stand-ins for the 30 files, named as the catalog names them."""
    src = packaged()["sources"]["nani-nithin-clef-flash"]["files"]
    return {e["file"]: b"GGUF" + tag + os.urandom(3_000) for e in src.values()}


@pytest.fixture
def seed_hub(tmp_path, monkeypatch):
    """The packaged catalog as it is, except that the head source points at fake head files."""
    data = packaged()
    head = data["sources"]["cloudflare-clef-flash"]
    head["revision"] = HEAD_REV
    for key, name in (("head_weights", "joint_head.safetensors"), ("tokenizer", "tokenizer.json")):
        head["files"][key].update(sha256=sha256(HEAD[name]), size=len(HEAD[name]))
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(data))
    server = FakeHub()
    server.add(SEED_REPO, C1, seed_files(b"one"))
    server.add(HEAD_REPO, HEAD_REV, HEAD)
    server.start()
    monkeypatch.setenv(CATALOG_ENV, str(path))
    point_at(monkeypatch, server, tmp_path / "hf")
    server.catalog = Catalog.from_dict(data)
    yield server
    server.stop()


def served(server, name, commit=C1) -> bytes:
    return server.repos[SEED_REPO].commits[commit][name]


def transfers(server, name) -> list[str]:
    return [p for m, p in server.requests if m == "GET" and p.endswith("/" + name)]


def test_every_seed_file_pulls_by_name_and_is_pinned(seed_hub):
    cat = seed_hub.catalog
    names = {q: e.file for q, e in cat.family("clef-flash").source("nani-nithin").files.items()}
    assert len(names) == 30
    for quant, file in names.items():
        path = hub.pull_file(f"clef-flash:{quant}@nani-nithin", catalog=cat, progress=False)
        assert (
            path.name == file
            and path.parent.name == C1
            and path.read_bytes() == served(seed_hub, file)
        )
    pins = json.loads(pins_path().read_text())
    assert pins["format"] == "clef-gguf-pins/1"
    entry = pins["repos"][SEED_REPO]
    assert entry["commit"] == C1 and entry["pinned_at"]
    assert entry["files"] == {
        f: {"sha256": sha256(served(seed_hub, f)), "size": len(served(seed_hub, f))}
        for f in names.values()
    }


def test_first_pull_pins_a_moved_main_is_refused_and_update_accepts_it(seed_hub):
    cat = seed_hub.catalog
    first = hub.pull("clef-flash:Q4_K_M@nani-nithin", catalog=cat, progress=False)
    assert first.tower.parent.name == C1 and first.name == "clef-flash:Q4_K_M@nani-nithin"
    assert pin(SEED_REPO)["commit"] == C1

    seed_hub.add(SEED_REPO, C2, seed_files(b"two"))  # main moves on
    with pytest.raises(PinMismatch) as err:
        hub.pull("clef-flash:Q4_K_M@nani-nithin", catalog=cat, progress=False)
    message = str(err.value)
    assert err.value.code == "pin_mismatch" and isinstance(err.value, ModelLoadError)
    assert (
        C1 in message
        and C2 in message
        and "clef-gguf pull clef-flash:Q4_K_M@nani-nithin --update" in message
    )
    assert not [
        p for m, p in seed_hub.requests if m == "GET" and f"/resolve/{C2}/" in p
    ]  # nothing fetched
    assert pin(SEED_REPO)["commit"] == C1

    # resolve (decide / serve / Clef.load) uses the pin, without asking where main is
    before = len(seed_hub.requests)
    again = hub.resolve("clef-flash:Q4_K_M@nani-nithin", allow_download=True, catalog=cat)
    assert again.tower == first.tower and len(seed_hub.requests) == before
    # a quant not pulled yet comes from the pinned commit too, not from main
    q8 = hub.resolve(
        "clef-flash:Q8_0@nani-nithin", allow_download=True, catalog=cat, progress=False
    )
    assert q8.tower.parent.name == C1 and q8.tower.read_bytes() == served(
        seed_hub, "clef-flash-Q8_0.gguf"
    )
    assert "clef-flash-Q8_0.gguf" in pin(SEED_REPO)["files"]

    updated = hub.pull("clef-flash:Q4_K_M@nani-nithin", catalog=cat, progress=False, update=True)
    assert updated.tower.parent.name == C2
    assert updated.tower.read_bytes() == served(seed_hub, "clef-flash-Q4_K_M.gguf", C2)
    entry = pin(SEED_REPO)
    assert entry["commit"] == C2 and list(entry["files"]) == [
        "clef-flash-Q4_K_M.gguf"
    ]  # old hashes gone
    assert hub.resolve("clef-flash:Q4_K_M@nani-nithin", catalog=cat).tower == updated.tower
    [m] = [m for m in listing.list_local(catalog=cat) if m.commit == C1 and m.quant == "Q4_K_M"]
    assert not m.pinned and m.source_pinned  # the old copy is no longer the pinned revision


def test_a_changed_file_at_the_same_name_is_refused(seed_hub, tmp_path):
    cat = seed_hub.catalog
    name = "clef-flash-Q4_K_M.gguf"
    first = hub.pull("clef-flash:Q4_K_M@nani-nithin", catalog=cat, progress=False)
    pinned = pin(SEED_REPO)["files"][name]["sha256"]
    changed = b"GGUF" + os.urandom(3_000)
    seed_hub.repos[SEED_REPO].commits[C1][name] = changed  # same commit, same name, other bytes

    with pytest.raises(
        PinMismatch, match=f"{name} at commit {C1} is now sha256 {sha256(changed)}"
    ) as err:
        hub.pull("clef-flash:Q4_K_M@nani-nithin", catalog=cat, progress=False)
    assert pinned in str(err.value) and "--update" in str(err.value)
    assert first.tower.read_bytes() != changed  # the pinned copy is still there and still used
    assert hub.resolve("clef-flash:Q4_K_M@nani-nithin", catalog=cat).tower == first.tower

    # Without a cached copy the download itself is refused before any byte is transferred.
    shutil.rmtree(tmp_path / "hf" / "hub" / "models--NANI-Nithin--clef-flash-GGUF")
    before = len(transfers(seed_hub, name))
    with pytest.raises(PinMismatch, match="not using it"):
        hub.resolve(
            "clef-flash:Q4_K_M@nani-nithin", allow_download=True, catalog=cat, progress=False
        )
    assert len(transfers(seed_hub, name)) == before
    assert pin(SEED_REPO)["files"][name]["sha256"] == pinned

    accepted = hub.pull("clef-flash:Q4_K_M@nani-nithin", catalog=cat, progress=False, update=True)
    assert accepted.tower.read_bytes() == changed
    assert pin(SEED_REPO)["files"][name]["sha256"] == sha256(changed)


def test_update_of_a_cached_file_changed_at_the_same_commit_fetches_the_new_bytes(seed_hub):
    cat = seed_hub.catalog
    hub.pull("clef-flash:Q2_K@nani-nithin", catalog=cat, progress=False)
    changed = b"GGUF" + os.urandom(3_000)
    seed_hub.repos[SEED_REPO].commits[C1]["clef-flash-Q2_K.gguf"] = changed
    files = hub.pull("clef-flash:Q2_K@nani-nithin", catalog=cat, progress=False, update=True)
    assert files.tower.read_bytes() == changed
    assert hub.resolve("clef-flash:Q2_K@nani-nithin", catalog=cat).tower.read_bytes() == changed


def test_offline_resolve_uses_the_pinned_commit(seed_hub, monkeypatch):
    cat = seed_hub.catalog
    hub.pull("clef-flash:IQ2_M@nani-nithin", catalog=cat, progress=False)
    seed_hub.add(SEED_REPO, C2, seed_files(b"two"))
    hub.pull_file(
        "clef-flash:IQ2_M@nani-nithin", catalog=cat, progress=False, update=True
    )  # caches C2
    record_pin(
        SEED_REPO,
        C1,
        "clef-flash-IQ2_M.gguf",
        sha256(served(seed_hub, "clef-flash-IQ2_M.gguf")),
        3_007,
        update=True,
        name="x",
    )  # back to C1 while refs/main says C2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seed_hub.fail_all = True
    files = hub.resolve("clef-flash:IQ2_M@nani-nithin", allow_download=True, catalog=cat)
    assert files.tower.parent.name == C1


def test_the_pin_is_check_and_set(seed_hub):
    entry = record_pin("o/r", C1, "a.gguf", "a" * 64, 1, update=False, name="n")
    assert entry["commit"] == C1
    with pytest.raises(PinMismatch, match="has moved since its first pull"):
        record_pin("o/r", C2, "a.gguf", "a" * 64, 1, update=False, name="n")
    with pytest.raises(PinMismatch, match="not using it"):
        record_pin("o/r", C1, "a.gguf", "b" * 64, 1, update=False, name="n")
    record_pin("o/r", C1, "b.gguf", "b" * 64, 1, update=False, name="n")
    assert set(pin("o/r")["files"]) == {"a.gguf", "b.gguf"}
    pins_path().write_text("{half")
    with pytest.raises(ModelLoadError, match="cannot read the pins"):
        pin("o/r")


def test_cli_pull_refuses_a_move_with_a_stable_code_and_update_re_pins(seed_hub, capsys):
    assert cli.main(["pull", "clef-flash:Q4_K_M@nani-nithin", "--no-progress", "--json"]) == 0
    captured = capsys.readouterr()
    assert "no pinned revision" in captured.err and "pins.json" in captured.err
    assert json.loads(captured.out)["tower"].endswith(f"{C1}/clef-flash-Q4_K_M.gguf")

    seed_hub.add(SEED_REPO, C2, seed_files(b"two"))
    assert cli.main(["pull", "clef-flash:Q4_K_M@nani-nithin", "--no-progress"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "pin_mismatch" and "--update" in error["message"]

    assert (
        cli.main(["pull", "clef-flash:Q4_K_M@nani-nithin", "--no-progress", "--update", "--json"])
        == 0
    )
    captured = capsys.readouterr()
    assert f"re-pinned {SEED_REPO}: {C1} -> {C2}" in captured.err
    assert json.loads(captured.out)["tower"].endswith(f"{C2}/clef-flash-Q4_K_M.gguf")

    parser = argparse.ArgumentParser()
    commands.add_list_arguments(parser)
    assert commands.run_list(parser.parse_args(["--available", "--json"])) == 0
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)}[
        "clef-flash:Q4_K_M@nani-nithin"
    ]
    assert (row["revision"], row["pinned_by"]) == (C2, "first pull")
    assert commands.run_list(parser.parse_args([])) == 0
    text = capsys.readouterr().out
    assert "clef-flash:Q4_K_M@nani-nithin" in text and "(pinned at first pull) ready" in text
    assert "(not the pinned revision)" in text  # the C1 copy

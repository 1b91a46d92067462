"""From a catalog name to a decision: `clef-gguf pull` and `decide --model clef-flash:auto` through a
fake Hub serving the tiny model's real files (huggingface_hub's real download code, loopback only)."""

import json
import subprocess

import pytest

from _fakehub import FakeHub, sha256, tiny_catalog

TOWER_REPO, HEAD_REPO = "test-org/clef-flash-GGUF", "test-org/clef-flash"
TOWER_REV, HEAD_REV = "e" * 40, "f" * 40
REQUEST = {"state": "Server disk 97% full, writes failing.",
           "questions": {"page": {"type": "noul", "instructions": "Page the on-call engineer?"}}}


@pytest.fixture
def hub_env(tiny_model_dir, tmp_path):
    tower = (tiny_model_dir / "tower-f32.gguf").read_bytes()
    head = {name: (tiny_model_dir / name).read_bytes()
            for name in ("joint_head.safetensors", "joint_head_config.json", "tokenizer.json")}
    server = FakeHub()
    server.add(TOWER_REPO, TOWER_REV, {"Clef-Tiny-Q8_0.gguf": tower})
    server.add(HEAD_REPO, HEAD_REV, head)
    server.start()
    catalog = tiny_catalog(head, tower, HEAD_REPO, HEAD_REV, TOWER_REPO, TOWER_REV)
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog))
    env = {"HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"), "CLEF_GGUF_CATALOG": str(path)}
    server.tower_sha256 = sha256(tower)
    yield server, env
    server.stop()


def run(env, *args, stdin=None):
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))} | env
    return subprocess.run(["clef-gguf", *args], input=stdin, capture_output=True, text=True, env=full,
                          timeout=300)


def test_decide_with_a_catalog_name_downloads_then_works_offline(hub_env):
    server, env = hub_env
    first = run(env, "decide", "--model", "clef-flash:auto", stdin=json.dumps(REQUEST))
    assert first.returncode == 0, first.stdout + first.stderr
    answer = json.loads(first.stdout)
    assert 0 <= answer["answers"]["page"]["noul"] <= 1
    assert answer["audit"]["model_hash"] == server.tower_sha256
    assert answer["model"] == "clef-flash:Q8_0@testsrc"
    downloads = [p for m, p in server.requests if m == "GET" and "/resolve/" in p]
    assert len(downloads) == 4  # tower, head, head config, tokenizer

    offline = run(env | {"HF_HUB_OFFLINE": "1"}, "decide", "--model", "clef-flash:Q8_0",
                  stdin=json.dumps(REQUEST))
    assert offline.returncode == 0, offline.stdout + offline.stderr
    assert json.loads(offline.stdout)["answers"] == answer["answers"]


def test_offline_flag_refuses_to_download(hub_env):
    server, env = hub_env
    proc = run(env, "decide", "--offline", "--model", "clef-flash:Q8_0", stdin=json.dumps(REQUEST))
    assert proc.returncode == 1
    err = json.loads(proc.stdout)["error"]
    assert "pull" in err["message"]
    assert not [p for m, p in server.requests if m == "GET" and "/resolve/" in p]


def test_pull_then_list(hub_env):
    _, env = hub_env
    pulled = run(env, "pull", "clef-flash:Q8_0", "--no-progress", "--json")
    assert pulled.returncode == 0, pulled.stderr
    listed = run(env, "list", "--json")
    assert [m["quant"] for m in json.loads(listed.stdout)] == ["Q8_0"]

"""A loopback stand-in for the Hugging Face Hub, just enough for huggingface_hub's real download code.

Implements (as huggingface_hub's file_download.py / hf_api.py expect them):
  HEAD/GET /{owner}/{name}/resolve/{revision}/{path}  -> X-Repo-Commit, ETag, X-Linked-Etag (LFS sha256),
      X-Linked-Size, Content-Length; GET honours ``Range: bytes=N-`` and ``bytes=N-M`` (206 +
      Content-Range), and counts the bytes it sends of each file (``served``)
  GET /api/models/{owner}/{name}/tree/{revision}      -> the file listing (with ``lfs.oid`` = sha256)
  404s carry X-Error-Code (RepoNotFound / RevisionNotFound / EntryNotFound) like the Hub.
A file can be served corrupted (different bytes than its advertised sha256) to test verification.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    # path -> bytes actually sent (the advertised sha256/size stay those of the real content)
    corrupt: dict[str, bytes] = field(default_factory=dict)
    # paths whose first full GET breaks off half-way (to exercise huggingface_hub's resume with Range)
    drop_once: set[str] = field(default_factory=set)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.served: dict[str, int] = {}  # file path in its repo -> bytes of it sent (GET bodies)
        self.fail_all = False  # answer 503 to everything, like an outage
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo: str, commit: str, files: dict[str, bytes], *, main: bool = True) -> None:
        r = self.repos.setdefault(repo, FakeRepo())
        r.commits[commit] = dict(files)
        if main:
            r.refs["main"] = commit

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _send(self, status, headers, payload=b"", body=True):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body and payload:
                    self.wfile.write(payload)

            def _error(self, status, code, body, extra=None):
                msg = json.dumps({"error": code}).encode()
                self._send(status, {"X-Error-Code": code, "Content-Type": "application/json",
                                    **(extra or {})}, msg, body)

            def _serve(self, body):
                if self.path.startswith("/api/agent-harnesses"):  # huggingface_hub's daily registry fetch
                    return self._error(404, "NotFound", body)
                hub.requests.append((self.command, self.path))
                if hub.fail_all:
                    return self._error(503, "ServiceUnavailable", body)
                parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                    return self._tree("/".join(parts[2:4]), parts[5], body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
                return self._error(404, "NotFound", body)

            def _commit(self, repo, revision, body):
                r = hub.repos.get(repo)
                if r is None:
                    self._error(404, "RepoNotFound", body)
                    return None, None
                commit = revision if revision in r.commits else r.refs.get(revision)
                if commit is None:
                    self._error(404, "RevisionNotFound", body)
                    return None, None
                return r, commit

            def _tree(self, repo, revision, body):
                r, commit = self._commit(repo, revision, body)
                if r is None:
                    return
                items = []
                for path, data in sorted(r.commits[commit].items()):
                    item = {"type": "file", "path": path, "size": len(data), "oid": sha256(data)[:40]}
                    if path.endswith(LFS_SUFFIXES):
                        item["lfs"] = {"oid": sha256(data), "size": len(data), "pointerSize": 134}
                    items.append(item)
                self._send(200, {"Content-Type": "application/json"}, json.dumps(items).encode(), body)

            def _resolve(self, repo, revision, path, body):
                r, commit = self._commit(repo, revision, body)
                if r is None:
                    return
                files = r.commits[commit]
                if path not in files:
                    return self._error(404, "EntryNotFound", body, {"X-Repo-Commit": commit})
                real = files[path]
                sent = r.corrupt.get(path, real)
                lfs = path.endswith(LFS_SUFFIXES)
                etag = sha256(real) if lfs else hashlib.sha1(b"blob %d\0" % len(real) + real).hexdigest()
                headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                if lfs:
                    headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(real))})
                start, end = 0, len(sent) - 1
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and body:
                    first, _, last = rng[6:].partition("-")
                    start = int(first or 0)
                    end = min(int(last), end) if last else end
                ranged = start > 0 or end < len(sent) - 1
                payload = sent[start:end + 1]
                if ranged:
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(sent)}"
                headers["Content-Length"] = str(len(payload))
                if body:
                    hub.served[path] = hub.served.get(path, 0) + len(payload)
                if body and not ranged and path in r.drop_once:
                    r.drop_once.discard(path)
                    self.send_response(200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.close_connection = True  # the client sees a short body: a dropped connection
                    return
                self._send(206 if ranged else 200, headers, payload, body)

        return Handler


def point_at(monkeypatch, server: FakeHub, hf_home) -> None:
    """Send huggingface_hub to ``server`` with a fresh cache at ``hf_home``, whatever this machine
    had set (a CI machine with HF_HUB_OFFLINE set must not break the tests)."""
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub.constants  # it froze HF_HUB_OFFLINE at import

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def head_source(repo: str, revision: str, head: dict[str, bytes]) -> dict:
    """The catalog entry of a head repository serving ``head`` (file name -> bytes)."""
    return {"family": "clef-flash", "alias": "cloudflare", "role": "head", "repo": repo,
            "revision": revision, "files": {
                "head_weights": {"file": "joint_head.safetensors",
                                 "sha256": sha256(head["joint_head.safetensors"])},
                "head_config": {"file": "joint_head_config.json"},
                "tokenizer": {"file": "tokenizer.json", "sha256": sha256(head["tokenizer.json"])}}}



def tiny_catalog(head: dict[str, bytes], tower: bytes, head_repo: str, head_rev: str, tower_repo: str,
                 tower_rev: str) -> dict:
    """A catalog of one family: the tiny model's head files and its Q8_0-named tower, in two repos."""
    return {
        "format": "clef-gguf-catalog/1",
        "quant_types": {"order": ["Q8_0"], "bpw": {"Q8_0": 8.5}},
        "families": {"clef-flash": {
            "architecture": {"hidden_size": 64, "layers": 4, "recurrent_layers": 3, "attention_layers": 1,
                             "attention_heads": 4, "kv_heads": 2, "head_dim": 16, "vocab_size": 512,
                             "max_context": 32768},
            "memory": {"kv_bytes_per_token": 128, "recurrent_bytes_per_sequence": 65536,
                       "head_bytes": 1 << 20, "activation_bytes_per_token": 64, "compute_bytes": 1 << 20,
                       "runtime_bytes": 1 << 20},
            "size_estimate": {"overhead_bytes": 0, "bytes_per_bpw": 1},
            "head_source": "head", "tower_sources": ["tower"], "other_sources": []}},
        "sources": {
            "head": head_source(head_repo, head_rev, head),
            "tower": {"family": "clef-flash", "alias": "testsrc", "role": "tower", "repo": tower_repo,
                      "revision": tower_rev, "files": {"Q8_0": {
                          "file": "Clef-Tiny-Q8_0.gguf", "size": len(tower), "sha256": sha256(tower)}}},
        },
    }


def nvfp4_checkpoint(*, shards: int = 1, head: dict[str, bytes] | None = None, scheme: str = "W4A16",
                     seed: int = 0) -> dict[str, bytes]:
    """The files of a tiny placeholder compressed-tensors NVFP4 checkpoint repository (file name ->
    bytes): config.json with its quantization_config, ``shards`` real safetensors files of packed
    tensors (+ model.safetensors.index.json when sharded), tokenizer files, ``head`` (the head files,
    or none: the repo then lacks them), and files a pull must leave alone (the card's runtime code, a
    README, a nested folder). Never run: pull and list only read names, config.json and the index."""
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(seed)
    activations = None if scheme == "W4A16" else {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                  "group_size": 16, "dynamic": "local"}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "quantization_config": {
                  "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head", "re:.*embed_tokens"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                                "weights": {"num_bits": 4, "type": "float", "group_size": 16,
                                                            "strategy": "tensor_group", "symmetric": True}}}}}
    files = {"config.json": json.dumps(config).encode(), "tokenizer.json": b'{"model": {}}',
             "tokenizer_config.json": b"{}", "README.md": b"# card", "clef_rt.py": b"raise SystemExit",
             "generation_config.json": b"{}", "extra/nested.safetensors": b"not taken"}
    names = (["model.safetensors"] if shards == 1 else
             [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)])
    weight_map = {}
    for i, name in enumerate(names):
        prefix = f"model.language_model.layers.{i}.mlp.down_proj"
        tensors = {f"{prefix}.weight_packed": rng.integers(0, 256, (16, 8), dtype=np.uint8),
                   f"{prefix}.weight_scale": rng.integers(0, 127, (16, 2), dtype=np.uint8),
                   f"{prefix}.weight_global_scale": np.array([448.0 * 6], dtype=np.float32)}
        files[name] = save(tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    if shards > 1:
        files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    files.update(head or {})
    return files


def cli_parsers(catalog: dict, tmp_path, monkeypatch) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``pull`` and ``list`` parsers as the CLI builds them, reading ``catalog`` (written to tmp_path)."""
    from clef_gguf.pick import catalog_commands as commands
    from clef_gguf.models.catalog import CATALOG_ENV

    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog))
    monkeypatch.setenv(CATALOG_ENV, str(path))
    pull_parser, list_parser = argparse.ArgumentParser(), argparse.ArgumentParser()
    commands.add_pull_arguments(pull_parser)
    commands.add_list_arguments(list_parser)
    return pull_parser, list_parser

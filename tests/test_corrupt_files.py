"""Damaged model files never crash the process (issue "Hardening" §3).

A copy of the tiny model directory is damaged in many seeded ways: deliberate rewrites of header
fields (GGUF counts, dims, types, offsets, alignment, architecture and qwen35 keys; the
safetensors header; tokenizer.json; the manifest), then random byte flips (mostly in headers) and
truncations. Each damaged directory is loaded with ``Clef.load`` and, when it loads, asked one
``decide``. llama.cpp aborts the whole process on some malformed files, so the cases run in a
child process that prints a line before and after each one: a child that dies or hangs names the
case that killed it, and a new child carries on with the rest.

Passing: no crash or hang, and every failure a model-load ClefError (``inference_error`` too for
garbage tensor data); loading and answering is fine. ``CLEF_CORRUPT_CASES`` sets the number of
cases (default 600: the ~380 deliberate ones, then random ones; ~30 s on 2 shared cores) and
``CLEF_CORRUPT_SEED`` the random ones (default 0). A full run (~1.5-2.5 min), with ``-s`` to see
the counts per file kind and outcome:

    CLEF_CORRUPT_CASES=3000 python -m pytest -q -s -p no:cacheprovider tests/test_corrupt_files.py
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

TOWER, WEIGHTS, CONFIG = "tower-f32.gguf", "joint_head.safetensors", "joint_head_config.json"
TOKENIZER, MANIFEST = "tokenizer.json", "clef-gguf.json"
KINDS = {"tower": TOWER, "head_weights": WEIGHTS, "head_config": CONFIG, "tokenizer": TOKENIZER,
         "manifest": MANIFEST}
# Share of the random cases per file kind: the tower has the most structure to get wrong.
RANDOM_SHARE = {"tower": 0.5, "head_weights": 0.15, "head_config": 0.1, "tokenizer": 0.15,
                "manifest": 0.1}
LOAD_ERRORS = {"corrupt_model", "model_not_found", "head_mismatch", "model_load_error"}
# Finite but garbage weights may still overflow to inf in the forward pass.
DATA_KINDS = {"tower", "head_weights"}
REQUEST = {"state": {"ticket": "Refund not received"},
           "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                         "team": {"type": "choice", "instructions": "Which team?",
                                  "criteria": {"billing": "Payments", "tech": None}}}}
MARK = "@@case "
CASE_TIMEOUT_S = 20  # a case takes well under a second; longer is a hang
DEFAULT_CASES = 600


def u32(v: int) -> bytes:
    return struct.pack("<I", v % 2**32)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def case(kind: str, name: str, splices: list, must_fail: bool = False, xor=()) -> dict:
    """``splices``: (start, end, bytes) replacing ``data[start:end]`` of the pristine file;
    ``xor``: (offset, mask) flipping bits of pristine bytes."""
    return {"id": f"{kind}:{name}", "kind": kind, "file": KINDS[kind], "must_fail": must_fail,
            "splices": [[int(a), int(b), bytes(raw).hex()] for a, b, raw in splices],
            "xor": [[int(a), int(m)] for a, m in xor]}


def whole(kind: str, name: str, data: bytes, size: int, must_fail: bool = False) -> dict:
    return case(kind, name, [(0, size, data)], must_fail)


# ---------------------------------------------------------------------------------------- GGUF
class Header:
    """Byte offsets of the pristine tower's header parts, from gguf-py's parse."""

    def __init__(self, path: Path):
        import gguf

        reader = gguf.GGUFReader(path)
        self.size, self.data_offset = path.stat().st_size, int(reader.data_offset)
        self.kv = dict(reader.fields)
        self.tensors = {t.name: t for t in reader.tensors}
        self.spans = [(f.offset, self.end(f)) for f in reader.fields.values()]
        self.spans += [(t.field.offset, self.end(t.field)) for t in reader.tensors]

    @staticmethod
    def part(field, i: int) -> int:
        return int(field.offset + sum(int(p.nbytes) for p in field.parts[:i]))

    def end(self, field) -> int:
        return self.part(field, len(field.parts))

    def value(self, key: str) -> int:
        """Offset of a scalar kv's value (parts: key length, key, type, value)."""
        return self.part(self.kv[key], 3)


def tower_rewrites(h: Header) -> list[dict]:
    out = []

    def put(name, offset, raw, must_fail=False):
        out.append(case("tower", name, [(offset, offset + len(raw), raw)], must_fail))

    for v in (0, 55, 57, 2**32, 2**64 - 1):
        put(f"tensor_count={v}", 8, u64(v))
    for v in (0, 33, 35, 2**40, 2**64 - 1):
        put(f"kv_count={v}", 16, u64(v))
    put("magic=GGUX", 0, b"GGUX", True)
    for v in (0, 1, 2, 4, 2**32 - 1):
        put(f"version={v}", 4, u32(v))
    for tname in ("output.weight", "blk.0.attn_qkv.weight"):
        f = h.tensors[tname].field
        for v in (0, 1, 3, 5, 2**32 - 1):
            put(f"{tname}.n_dims={v}", h.part(f, 2), u32(v))
    for tname, axis, values in (("output.weight", 0, (0, 65, 128, 2**32, 2**63)),
                                ("output.weight", 1, (0, 641, 1280, 2**32, 2**63)),
                                ("token_embd.weight", 1, (0, 639, 2**33, 2**64 - 1)),
                                ("blk.0.attn_qkv.weight", 1, (0, 127, 2**33, 2**64 - 1)),
                                ("blk.3.attn_q_norm.weight", 0, (0, 31, 2**33, 2**64 - 1))):
        f = h.tensors[tname].field
        for v in values:
            put(f"{tname}.dim{axis}={v}", h.part(f, 3) + 8 * axis, u64(v))
    for tname, types in (("output.weight", (1, 8, 12, 30, 41, 42, 99, 2**32 - 1)),
                         ("blk.0.ffn_down.weight", (1, 2, 30, 42, 99))):
        f = h.tensors[tname].field
        for v in types:
            put(f"{tname}.type={v}", h.part(f, 4), u32(v))
    data_len = h.size - h.data_offset
    f = h.tensors["output.weight"].field
    base = int(f.parts[5][0])
    for v in (base + 1, base + 32, base - 32, 2**40, 2**64 - 32, data_len):
        put(f"output.weight.offset={v}", h.part(f, 5), u64(v))
    f = h.tensors["blk.3.ffn_down.weight"].field
    for v in (data_len, data_len - 16, 0):
        put(f"blk.3.ffn_down.weight.offset={v}", h.part(f, 5), u64(v))
    # general.file_type has a key of the same length: renamed, it becomes the alignment key.
    f = h.kv["general.file_type"]
    for v in (0, 1, 3, 16, 32, 64, 2**31, 2**32 - 1):
        out.append(case("tower", f"general.alignment={v}",
                        [(h.part(f, 1), h.part(f, 2), b"general.alignment"),
                         (h.part(f, 3), h.part(f, 4), u32(v))]))
    f = h.kv["general.architecture"]
    for arch in (b"qwen36", b"llama4", b"gemma3", b"\xff\xfe\x00qwe"):
        put(f"architecture={arch!r}", h.part(f, 4), arch, True)
    for v in (0, 5, 7, 2**40):
        put(f"architecture.length={v}", h.part(f, 3), u64(v), True)
    for key, values in (("qwen35.block_count", (0, 1, 3, 5, 64, 2**31, 2**32 - 1)),
                        ("qwen35.embedding_length", (0, 1, 32, 63, 65, 128, 2**31, 2**32 - 1)),
                        ("qwen35.context_length", (0, 1)),
                        ("qwen35.feed_forward_length", (0, 2**31)),
                        ("qwen35.attention.head_count", (0, 3, 2**31)),
                        ("qwen35.attention.head_count_kv", (0, 3, 5)),
                        ("qwen35.attention.key_length", (0, 2**31)),
                        ("qwen35.attention.value_length", (0,)),
                        ("qwen35.rope.dimension_count", (0, 2**31)),
                        ("qwen35.ssm.conv_kernel", (0, 2**31)),
                        ("qwen35.ssm.state_size", (0, 7)),
                        ("qwen35.ssm.group_count", (0, 3)),
                        ("qwen35.ssm.time_step_rank", (0, 3)),
                        ("qwen35.ssm.inner_size", (0, 2**31)),
                        ("qwen35.full_attention_interval", (0, 1, 5, 2**32 - 1)),
                        ("tokenizer.ggml.eos_token_id", (640, 2**31)),
                        ("tokenizer.ggml.bos_token_id", (2**32 - 1,))):
        for v in values:
            put(f"{key}={v}", h.value(key), u32(v))
    for v in (float("nan"), -1.0, 0.0):
        put(f"layer_norm_rms_epsilon={v}", h.value("qwen35.attention.layer_norm_rms_epsilon"),
            struct.pack("<f", v))
    for key, values in (("tokenizer.ggml.tokens", (0, 1, 639, 641, 2**32, 2**64 - 1)),
                        ("tokenizer.ggml.token_type", (0, 639, 641, 2**40)),
                        ("tokenizer.ggml.merges", (0, 2**40)),
                        ("qwen35.attention.recurrent_layers", (0, 3, 5)),
                        ("qwen35.rope.dimension_sections", (0, 2**40))):
        for v in values:
            put(f"{key}.count={v}", h.part(h.kv[key], 4), u64(v))
    f = h.kv["qwen35.rope.dimension_sections"]
    for v in (3, 100, 2**31 - 1, -1):
        put(f"rope.dimension_sections[0]={v}", h.part(f, 5), struct.pack("<i", v))
    f = h.kv["tokenizer.ggml.tokens"]
    texts = [bytes(f.parts[i]) for i in f.data]
    i, j = next((i, j) for i in range(len(texts)) for j in range(i + 1, len(texts))
                if len(texts[i]) == len(texts[j]))
    put(f"token {j} a copy of token {i}", h.part(f, int(f.data[j])), texts[i])
    for key, type_id in (("qwen35.block_count", 8), ("qwen35.block_count", 6),
                         ("qwen35.block_count", 9), ("qwen35.block_count", 13),
                         ("qwen35.embedding_length", 6), ("tokenizer.ggml.tokens", 8)):
        put(f"{key}.type={type_id}", h.part(h.kv[key], 2), u32(type_id))
    for key in ("qwen35.block_count", "qwen35.embedding_length", "general.architecture",
                "tokenizer.ggml.tokens", "qwen35.attention.head_count"):  # the key goes missing
        put(f"missing {key}", h.part(h.kv[key], 2) - 1, b"~")
    # A duplicate key and a duplicate tensor name (same length, so nothing else moves).
    put("duplicate key", h.part(h.kv["qwen35.ssm.state_size"], 1), b"qwen35.ssm.inner_size")
    put("duplicate tensor", h.part(h.tensors["blk.1.attn_norm.weight"].field, 1),
        b"blk.0.attn_norm.weight")
    put("missing output.weight", h.part(h.tensors["output.weight"].field, 1), b"outpux")
    put("tensor name not utf-8", h.part(h.tensors["blk.2.ssm_a"].field, 1), b"\xff\xfe")
    return out


def tower_random(h: Header, rng: np.random.Generator, n: int) -> list[dict]:
    out = []
    for i in range(n):
        mode = rng.choice(["field", "header", "data", "truncate"], p=[0.35, 0.25, 0.2, 0.2])
        if mode == "truncate":
            at = int(rng.integers(0, h.data_offset) if rng.random() < 0.5
                     else rng.integers(h.data_offset, h.size))
            out.append(case("tower", f"truncate#{i}@{at}", [(at, h.size, b"")]))
            continue
        spots = []
        for _ in range(int(rng.integers(1, 5))):
            if mode == "field":  # a byte of one kv or tensor-info entry: lengths, types, values
                start, end = h.spans[int(rng.integers(len(h.spans)))]
            elif mode == "header":
                start, end = 0, h.data_offset
            else:
                start, end = h.data_offset, h.size
            spots.append(int(rng.integers(start, end)))
        out.append(flips("tower", f"{mode}-flip#{i}", spots, rng))
    return out


def flips(kind: str, name: str, spots, rng, alphabet: bytes | None = None) -> dict:
    """One byte at each of ``spots`` XORed with a random non-zero mask, or (``alphabet``) set to a
    random character of it."""
    if alphabet is None:
        return case(kind, name, [], xor=[(at, rng.integers(1, 256)) for at in spots])
    return case(kind, name, [(at, at + 1, bytes([alphabet[rng.integers(len(alphabet))]]))
                             for at in spots])


# ---------------------------------------------------------------------------------- safetensors
JSONISH = b'0123456789[]{}",:-.eE FBIU_ abcdefxyz\\'


def weights_rewrites(raw: bytes) -> list[dict]:
    size, hlen = len(raw), struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + hlen])
    names = sorted(k for k in header if k != "__metadata__")
    first, second = names[0], names[1]
    out = [case("head_weights", f"header_length={v}", [(0, 8, u64(v))])
           for v in (0, 1, 2, hlen - 1, hlen + 1, size - 8, size, 2**40, 2**64 - 1)]

    def put(name: str, new_header: object) -> None:
        text = new_header if isinstance(new_header, bytes) else json.dumps(new_header).encode()
        out.append(case("head_weights", name, [(0, 8 + hlen, u64(len(text)) + text)]))

    def put_entry(key: str, value: object, label: str) -> None:
        put(f"{key} {label}", {**header, first: {**header[first], key: value}})

    begin, end = header[first]["data_offsets"]
    shape = header[first]["shape"]
    for label, value in (("[]", []), ("[0]", [0]), ("double", [shape[0] * 2, *shape[1:]]),
                         ("reversed", shape[::-1]), ("negative", [-1, *shape[1:]]),
                         ("huge", [2**40, *shape[1:]]), ("overflow", [2**62, 2**62]),
                         ("text", "abc"), ("float", [1.5]), ("nested", [[1]])):
        put_entry("shape", value, label)
    for dtype in ("F32", "F16", "F64", "I64", "BOOL", "F8_E4M3", "U8", "XX", 5, None):
        put_entry("dtype", dtype, repr(dtype))
    data_len = size - 8 - hlen
    for label, value in (("empty", [0, 0]), ("reversed", [end, begin]),
                         ("past end", [begin, data_len + 2]), ("huge", [begin, 2**40]),
                         ("negative", [-2, end]), ("one", [begin]), ("text", "x"),
                         ("another's", header[second]["data_offsets"]),
                         ("overflow", [2**64 - 2, 2**64 + end - begin - 2])):
        put_entry("data_offsets", value, label)
    put("missing dtype", {**header, first: {k: v for k, v in header[first].items()
                                            if k != "dtype"}})
    put("missing tensor", {k: v for k, v in header.items() if k != first})
    put("extra tensor", {**header, "extra": header[first]})
    put("all at one offset", {k: {**v, "data_offsets": [0, 2]} if k != "__metadata__" else v
                              for k, v in header.items()})
    put("metadata not strings", {**header, "__metadata__": {"format": 5}})
    put("metadata a list", {**header, "__metadata__": []})
    for label, text in (("array", b"[]"), ("null", b"null"), ("number", b"7"),
                        ("not utf-8", b'{"\xff\xfe": 1}'), ("nul padded", b"{}\x00\x00")):
        put(f"header {label}", text)
    return out


def weights_random(raw: bytes, rng, n: int) -> list[dict]:
    size, hlen, out = len(raw), struct.unpack("<Q", raw[:8])[0], []
    for i in range(n):
        mode = rng.choice(["header", "data", "truncate"], p=[0.65, 0.15, 0.2])
        if mode == "truncate":
            at = int(rng.integers(0, 8 + hlen) if rng.random() < 0.6 else rng.integers(8, size))
            out.append(case("head_weights", f"truncate#{i}@{at}", [(at, size, b"")]))
            continue
        lo, hi = (8, 8 + hlen) if mode == "header" else (8 + hlen, size)
        spots = rng.integers(lo, hi, size=int(rng.integers(1, 4)))
        out.append(flips("head_weights", f"{mode}-flip#{i}", spots, rng,
                         JSONISH if mode == "header" and rng.random() < 0.7 else None))
    return out


# ----------------------------------------------------------------------------------- JSON files
POOL = [None, True, False, -1, 0, 1, 2**31, 2**64, 1.5, 1e308, "", "x", "../x", [], {}, [1],
        {"type": "x"}, ["a", "b"]]


def json_paths(obj, prefix=(), depth=4, limit=8):
    """Paths into ``obj`` (at most ``limit`` children per container): what a mutation replaces."""
    yield prefix
    if depth == 0:
        return
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) \
        else ()
    for i, (key, value) in enumerate(items):
        if i >= limit:
            break
        yield from json_paths(value, (*prefix, key), depth - 1, limit)


def replaced(obj, path, value):
    obj = json.loads(json.dumps(obj))
    if not path:
        return value
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj


def json_random(kind: str, raw: bytes, rng, n: int) -> list[dict]:
    obj, out = json.loads(raw), []
    paths = list(json_paths(obj))
    for i in range(n):
        mode = rng.choice(["flip", "truncate", "value"], p=[0.45, 0.2, 0.35])
        if mode == "truncate":
            at = int(rng.integers(0, len(raw)))
            out.append(case(kind, f"truncate#{i}@{at}", [(at, len(raw), b"")]))
        elif mode == "flip":
            spots = rng.integers(0, len(raw), size=int(rng.integers(1, 4)))
            alphabet = JSONISH if rng.random() < 0.5 else None
            out.append(flips(kind, f"flip#{i}", spots, rng, alphabet))
        else:
            path = paths[int(rng.integers(len(paths)))]
            value = POOL[int(rng.integers(len(POOL)))]
            new = json.dumps(replaced(obj, path, value)).encode()
            out.append(whole(kind, f"value#{i} {'.'.join(map(str, path))}={value!r}", new,
                             len(raw)))
    return out


def invalid_json(kind: str, size: int) -> list[dict]:
    texts = {"empty": b"", "open brace": b"{", "array": b"[]", "null": b"null",
             "deep nesting": b"[" * 100_000 + b"]" * 100_000, "not utf-8": b'{"a": "\xff\xfe"}',
             "binary": bytes(range(256))}
    return [whole(kind, f"invalid json: {label}", text, size, True)
            for label, text in texts.items()]


def config_rewrites(raw: bytes) -> list[dict]:
    config, out = json.loads(raw), invalid_json("head_config", len(raw))

    def put(name, obj, must_fail=True):
        out.append(whole("head_config", name, json.dumps(obj).encode(), len(raw), must_fail))

    for key in config:
        for value in ("64", True, -1, 2**63):
            put(f"{key}={value!r}", {**config, key: value})
        put(f"missing {key}", {k: v for k, v in config.items() if k != key})
    for key, value in (("layers", 10**6), ("routing_layers", 10**7), ("width", 2**40),
                       ("feedforward", 2**40), ("heads", 2**31)):
        put(f"{key}={value} (huge)", {**config, key: value})
    put("extra key", {**config, "extra": 1})
    put("dropout=2", {**config, "dropout": 2})
    put("width not divisible", {**config, "width": 33})
    return out


def tokenizer_rewrites(raw: bytes) -> list[dict]:
    tok, out = json.loads(raw), invalid_json("tokenizer", len(raw))

    def put(name, obj, must_fail=False):
        out.append(whole("tokenizer", name, json.dumps(obj).encode(), len(raw), must_fail))

    for model_type in ("WordPiece", "Unigram", "WordLevel", "Nope", 5):
        put(f"model.type={model_type}", replaced(tok, ("model", "type"), model_type))
    put("missing model", {k: v for k, v in tok.items() if k != "model"}, True)
    put("missing vocab", replaced(tok, ("model",), {k: v for k, v in tok["model"].items()
                                                    if k != "vocab"}), True)
    for label, vocab in (("list", []), ("negative id", {"a": -1}), ("huge id", {"a": 2**40}),
                         ("text id", {"a": "x"}), ("empty", {})):
        put(f"vocab {label}", replaced(tok, ("model", "vocab"), vocab))
    some_token = sorted(tok["model"]["vocab"])[100]
    put("vocab id past the GGUF vocab", replaced(tok, ("model", "vocab", some_token), 4000), True)
    for label, merges in (("text", "x"), ("one-element", [["a"]]), ("unknown tokens", ["qq zz"])):
        put(f"merges {label}", replaced(tok, ("model", "merges"), merges))
    for label, token_id in (("huge", 2**31), ("negative", -1), ("text", "x"), ("past vocab", 640)):
        put(f"added token id {label}", replaced(tok, ("added_tokens", 0, "id"), token_id))
    for part in ("pre_tokenizer", "normalizer", "post_processor", "decoder"):
        put(f"{part} unknown", replaced(tok, (part,), {"type": "Nope"}))
    put("bad regex", replaced(tok, ("pre_tokenizer", "pretokenizers", 0, "pattern", "Regex"), "(["))
    return out


def manifest_rewrites(raw: bytes, outside: Path) -> list[dict]:
    man, out = json.loads(raw), invalid_json("manifest", len(raw))

    def put(name, obj, must_fail=True):
        out.append(whole("manifest", name, json.dumps(obj).encode(), len(raw), must_fail))

    for role, name in (("tower", f"../{outside.name}/{TOWER}"), ("tower", str(outside / TOWER)),
                       ("tokenizer", f"../{outside.name}/{TOKENIZER}"),
                       ("head_weights", f"sub/../../{outside.name}/{WEIGHTS}"),
                       ("tower", ""), ("tower", "."), ("tower", "missing.gguf"),
                       ("tower", TOKENIZER), ("tower", MANIFEST), ("head_weights", TOWER),
                       ("head_config", TOKENIZER), ("tokenizer", CONFIG), ("tower", "a\x00b"),
                       ("tower", "a" * 5000), ("tower", 5), ("tower", None), ("tower", [TOWER]),
                       ("head_config", {"name": CONFIG})):
        put(f"{role}={name!r:.60}", {**man, role: name})
    put("tower=./tower", {**man, "tower": f"./{TOWER}"}, False)
    for value in ("clef-gguf/2", 1, None):
        put(f"format={value!r}", {**man, "format": value})
    put("missing format", {k: v for k, v in man.items() if k != "format"})
    for label, files in (("list", []), ("text", "x"), ("entry a list", {TOWER: []}),
                         ("bad types", {TOWER: {"sha256": 5, "size": "x"}}),
                         ("sha not hex", {TOWER: {"sha256": "zz", "size": 1}}),
                         ("outside", {f"../{outside.name}/{TOWER}": man["files"][TOWER]})):
        put(f"files {label}", {**man, "files": files})
    for key, value in (("name", 5), ("name", None), ("revision", {"a": 1}), ("revision", 5)):
        put(f"{key}={value!r}", {**man, key: value})
    return out


# ---------------------------------------------------------------------------------- the cases
def all_cases(src: Path, outside: Path, n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    raw = {name: (src / name).read_bytes() for name in KINDS.values()}
    h = Header(src / TOWER)
    # The deliberate cases first, then random ones, each kind from its own seeded stream.
    fixed = (tower_rewrites(h) + weights_rewrites(raw[WEIGHTS]) + config_rewrites(raw[CONFIG])
             + tokenizer_rewrites(raw[TOKENIZER]) + manifest_rewrites(raw[MANIFEST], outside))
    if n < len(fixed):
        keep = np.sort(rng.choice(len(fixed), size=n, replace=False))
        return [fixed[i] for i in keep]
    left = n - len(fixed)
    share = {kind: int(left * p) for kind, p in RANDOM_SHARE.items()}
    share["tower"] += left - sum(share.values())
    streams = {kind: np.random.default_rng(seed * 100 + i + 10) for i, kind in enumerate(KINDS)}
    return (fixed + tower_random(h, streams["tower"], share["tower"])
            + weights_random(raw[WEIGHTS], streams["head_weights"], share["head_weights"])
            + json_random("head_config", raw[CONFIG], streams["head_config"], share["head_config"])
            + json_random("tokenizer", raw[TOKENIZER], streams["tokenizer"], share["tokenizer"])
            + json_random("manifest", raw[MANIFEST], streams["manifest"], share["manifest"]))


def apply(data: bytes, c: dict) -> bytes:
    data = bytearray(data)
    for at, mask in c["xor"]:
        data[at] ^= mask
    for start, end, hexed in sorted(c["splices"], key=lambda s: -s[0]):  # back to front
        data[start:end] = bytes.fromhex(hexed)
    return bytes(data)


# ---------------------------------------------------------------------------------- the child
def child(src: Path, scratch: Path, cases_path: Path, start: int) -> None:
    import logging
    import resource

    import torch

    # A shared machine: an absurd allocation fails here as it would on a small host, not swaps.
    resource.setrlimit(resource.RLIMIT_AS, (24 << 30, resource.RLIM_INFINITY))
    torch.set_num_threads(1)
    logging.getLogger("clef_gguf").setLevel(logging.CRITICAL)  # llama.cpp's load errors: noise
    from clef_gguf import Clef
    from clef_gguf.core import errors

    pristine = {name: (src / name).read_bytes() for name in KINDS.values()}
    cases = json.loads(cases_path.read_text())

    def emit(message: dict) -> None:
        sys.stdout.write(MARK + json.dumps(message) + "\n")
        sys.stdout.flush()

    for index in range(start, len(cases)):
        c = cases[index]
        emit({"start": index})
        target = scratch / f"case-{index}"
        target.mkdir()
        for name, data in pristine.items():
            if name != MANIFEST:
                (target / name).write_bytes(apply(data, c) if name == c["file"] else data)
        # The manifest last, as the converter writes it.
        (target / MANIFEST).write_bytes(apply(pristine[MANIFEST], c)
                                        if c["file"] == MANIFEST else pristine[MANIFEST])
        try:
            with Clef.load(target, max_length=2048, threads=1) as clef:
                clef.decide(REQUEST)
            outcome, detail = "ok", ""
        except errors.ClefError as exc:
            outcome, detail = exc.code, exc.message
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - pyo3's PanicException is one; recorded
            outcome, detail = f"exception:{type(exc).__name__}", str(exc)
        emit({"end": index, "outcome": outcome, "detail": detail[:300]})
        shutil.rmtree(target, ignore_errors=True)


# ---------------------------------------------------------------------------------- the parent
def _death(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


def _last_words(err_path: Path) -> str:
    """The assert or exception a dead child printed (llama.cpp: ``GGML_ASSERT(...) failed``)."""
    lines = err_path.read_text(errors="replace").strip().splitlines()
    said = [line for line in lines if any(word in line for word in
                                          ("GGML_ASSERT", "GGML_ABORT", "terminate", "what()",
                                           "Fatal Python error", "error"))]
    return " | ".join(said[-3:] or lines[-3:])[-600:]


def run_cases(cases: list[dict], src: Path, scratch: Path) -> tuple[list, int]:
    """(outcome, detail) per case, and how many children ran."""
    cases_path = scratch / "cases.json"
    cases_path.write_text(json.dumps(cases))
    results: list = [None] * len(cases)
    # No gdb backtrace from ggml's abort handler: slow, and it buries the assert line.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GGML_NO_BACKTRACE": "1"}
    start, children = 0, 0
    while start < len(cases):
        children += 1
        err_path = scratch / f"child-{children}.stderr"
        with open(err_path, "w") as err:
            proc = subprocess.Popen([sys.executable, __file__, "child", str(src), str(scratch),
                                     str(cases_path), str(start)],
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines: queue.Queue = queue.Queue()

        def pump(stream=proc.stdout, lines=lines):
            for line in stream:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, progressed = None, False
        while True:
            try:
                line = lines.get(timeout=CASE_TIMEOUT_S)
            except queue.Empty:
                proc.kill()
                proc.wait()
                if current is None:
                    raise RuntimeError("the child stalled outside any case: "
                                       + err_path.read_text(errors="replace")[-2000:])
                results[current] = ("hang", f"no outcome within {CASE_TIMEOUT_S} s")
                break
            if line is None:
                rc = proc.wait()
                if current is not None:
                    results[current] = (f"crash:{_death(rc)}", _last_words(err_path))
                elif not progressed and start < len(cases):
                    raise RuntimeError(f"the child ran no case ({_death(rc)}): "
                                       + err_path.read_text(errors="replace")[-2000:])
                break
            if not line.startswith(MARK):
                continue
            msg = json.loads(line[len(MARK):])
            if "start" in msg:
                current = msg["start"]
            else:
                results[msg["end"]] = (msg["outcome"], msg["detail"])
                current, progressed = None, True
        proc.stdout.close()
        remaining = [i for i in range(start, len(cases)) if results[i] is None]
        start = remaining[0] if remaining else len(cases)
    return results, children


def acceptable(c: dict, outcome: str) -> bool:
    if outcome == "ok":
        return not c["must_fail"]
    return outcome in LOAD_ERRORS or (outcome == "inference_error" and c["kind"] in DATA_KINDS)


def test_damaged_files_are_load_errors_never_crashes(tiny_model_dir, tmp_path):
    n = int(os.environ.get("CLEF_CORRUPT_CASES", str(DEFAULT_CASES)))
    src = tmp_path / "pristine"
    shutil.copytree(tiny_model_dir, src)
    # Real files outside the case directories, for manifest names that try to reach them.
    outside = tmp_path / "outside"
    shutil.copytree(tiny_model_dir, outside)
    cases = all_cases(src, outside, n, int(os.environ.get("CLEF_CORRUPT_SEED", "0")))
    t0 = time.perf_counter()
    results, children = run_cases(cases, src, tmp_path)
    wall = time.perf_counter() - t0

    per_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for c, (outcome, _) in zip(cases, results):
        per_kind[c["kind"]][outcome] += 1
    print(f"\n{len(cases)} damaged model directories in {wall:.1f} s "
          f"({children} child process(es))")
    for kind in KINDS:
        counts = per_kind[kind]
        print(f"  {kind:13s}{sum(counts.values()):5d}  "
              + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    total = sum(per_kind.values(), collections.Counter())
    print("  outcomes     " + ", ".join(f"{k} {v}" for k, v in total.most_common()))
    bad = [f"{c['id']}: {outcome} {detail}" for c, (outcome, detail) in zip(cases, results)
           if not acceptable(c, outcome)]
    assert not bad, f"{len(bad)} case(s) not a clean load error:\n" + "\n".join(bad[:40])


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))

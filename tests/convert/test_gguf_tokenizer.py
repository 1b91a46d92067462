"""The tokenizer rebuilt from a GGUF's vocabulary (``convert/gguf_tokenizer.py``) vs the release's.

The tiny release's ``tokenizer.json`` (``convert/synthetic/tiny.py``: byte-level BPE plus Qwen's added tokens)
went into the GGUF through ``gguf_vocab``; rebuilt from the GGUF alone it must tokenize and decode
exactly like the original, and ``convert split`` without ``--tokenizer`` must give a model that
decides like one split with the release's file.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from pathlib import Path

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from clef_gguf.formats import files
from clef_gguf.convert import split as split_module
from clef_gguf.convert.gguf_tokenizer import tokenizer_from_gguf, tokenizer_spec
from clef_gguf.convert.split import add_split_arguments, run_split, split_native
from clef_gguf.convert.synthetic.tiny import PLAIN_ADDED_TOKENS, QWEN_PRETOKENIZE_REGEX, SPECIAL_TOKENS
from clef_gguf.pipeline.encode import (FIELD_END, OPTIONS_HEADER, PREFIX, SCHEMA_HEADER, SUFFIX, Encoder,
                              option_text, render)
from clef_gguf.core.errors import ConversionError
from clef_gguf.formats.gguf import open_gguf
from clef_gguf.pipeline.request import parse_request
# Test modules as helpers: tests/convert/ is on sys.path (rootdir-less conftest), tests/pipeline/ by this line.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
from test_encode import GOLDEN_BODY, GOLDEN_TEXT  # noqa: E402
from test_split import REQUESTS, _assert_decides_alike, _copy_field, write_native  # noqa: E402

TEXT_EXAMPLES, ID_EXAMPLES = 2000, 500
# The same examples on every run (and none stored): a failure reproduces without a database.
FIXED = dict(deadline=None, derandomize=True, database=None)
STR, I32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32


@pytest.fixture(scope="module")
def original(tiny_release) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny_release / files.TOKENIZER))


@pytest.fixture(scope="module")
def native(tiny_model_dir, tmp_path_factory):
    return write_native(tiny_model_dir, tmp_path_factory.mktemp("native") / "clef-tiny.gguf")


@pytest.fixture(scope="module")
def rebuilt(native) -> tokenizers.Tokenizer:
    return tokenizer_from_gguf(open_gguf(native))


def _assert_alike(original, rebuilt, text: str) -> list[int]:
    # The tiny vocab has few merges outside ASCII, so ids alone would hide a pre-tokenizer that
    # splits marks off their letters: compare the normalized text and the pre-tokens too.
    normalized = original.normalizer.normalize_str(text)
    assert rebuilt.normalizer.normalize_str(text) == normalized, text
    assert rebuilt.pre_tokenizer.pre_tokenize_str(normalized) == \
        original.pre_tokenizer.pre_tokenize_str(normalized), text
    a = original.encode(text, add_special_tokens=False)
    b = rebuilt.encode(text, add_special_tokens=False)
    assert b.ids == a.ids, text
    assert b.tokens == a.tokens, text
    for skip in (False, True):
        assert rebuilt.decode(b.ids, skip_special_tokens=skip) == \
            original.decode(a.ids, skip_special_tokens=skip), text
    return a.ids


# --------------------------------------------------------------------------- layout

def test_layout_is_the_release_tokenizers(original, native, rebuilt):
    want = json.loads(original.to_str())
    got = json.loads(rebuilt.to_str())
    assert got["model"]["vocab"] == want["model"]["vocab"]
    assert got["model"]["merges"] == want["model"]["merges"]
    assert got["model"]["type"] == "BPE" and got["model"]["unk_token"] is None
    assert got["model"]["byte_fallback"] is False
    pick = lambda tokens: [(t["id"], t["content"], t["special"]) for t in tokens]  # noqa: E731
    assert pick(got["added_tokens"]) == pick(want["added_tokens"])
    special = {t["content"]: t["special"] for t in got["added_tokens"]}
    assert special == {**dict.fromkeys(SPECIAL_TOKENS, True),
                       **dict.fromkeys(PLAIN_ADDED_TOKENS, False)}
    assert got["normalizer"] == {"type": "NFC"}
    split, byte_level = got["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"] == {"Regex": QWEN_PRETOKENIZE_REGEX} and split["behavior"] == "Isolated"
    assert byte_level == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False}
    assert got["decoder"]["type"] == "ByteLevel"
    # The GGUF's [PAD{i}] rows fill the embedding; the tokenizer never had them.
    n_gguf = len(open_gguf(native).fields["tokenizer.ggml.tokens"].data)
    assert rebuilt.get_vocab_size(with_added_tokens=True) == \
        original.get_vocab_size(with_added_tokens=True) < n_gguf
    assert not [t for t in rebuilt.get_vocab(with_added_tokens=True) if t.startswith("[PAD")]


# --------------------------------------------------------------------------- golden cases

GOLDEN_PIECES = [
    PREFIX, SUFFIX, SCHEMA_HEADER, OPTIONS_HEADER, FIELD_END, "\n", "OPTION 1: ", "OPTION 12: ",
    "\nFIELD 1\nID: urgent\nTYPE: noul\nINSTRUCTION: ", "Is it urgent?", '{"ask":"risk"}',
    option_text("true", None), option_text("overdue", "Invoice is past due."),
    option_text("x", {"b": 2, "a": 1}), option_text("0", "low"),
    render(GOLDEN_BODY["state"]), render({"é": "naïve", "ctl": "a\tb\u0000"}),
    render([1250.0, 1e-05, 1e16, 1.5e-07, 3, -0.0]), GOLDEN_TEXT,
    "hi <|im_end|> there", "<|im_start|>user\n<|im_end|><|im_end|>", "a<think>b</think>c",
    "résumé", unicodedata.normalize("NFD", "résumé"), "word " * 50, "नमस्ते สวัสดี x\u0301",
    "".join(SPECIAL_TOKENS + PLAIN_ADDED_TOKENS), "<|im_end", "<|unknown|>", "",
]


@pytest.mark.parametrize("text", GOLDEN_PIECES, ids=range(len(GOLDEN_PIECES)))
def test_prompt_pieces_tokenize_alike(original, rebuilt, text):
    _assert_alike(original, rebuilt, text)


def test_special_token_text_is_one_token(original, rebuilt):
    ids = _assert_alike(original, rebuilt, "hi <|im_end|> there")
    assert rebuilt.token_to_id("<|im_end|>") in ids


def test_encoder_encodes_requests_alike(original, rebuilt):
    a, b = Encoder(original), Encoder(rebuilt)
    for body in [GOLDEN_BODY, *REQUESTS]:
        ea, eb = a.encode(parse_request(body)), b.encode(parse_request(body))
        assert eb.ids.tolist() == ea.ids.tolist()
        assert eb.question_spans == ea.question_spans and eb.option_spans == ea.option_spans
    assert b.tokenizer.decode(b.encode(parse_request(GOLDEN_BODY)).ids.tolist(),
                              skip_special_tokens=False) == GOLDEN_TEXT


# --------------------------------------------------------------------------- random text

SAMPLES = [
    "नमस्ते दुनिया", "क्षत्रिय", "हिन्दी", "สวัสดีครับ", "ภาษาไทย", "กำ",
    unicodedata.normalize("NFD", "résumé café Ångström"), "e\u0301\u0302", "\u0301",
    "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "日本語", "한국어", "Ελληνικά",
    " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "\u00a0", "\u3000", "\u2028",
    "0", "42", "3.14159", "١٢٣", "१२३", "'s", "'LL", "don't", "I'M",
    *SPECIAL_TOKENS, *PLAIN_ADDED_TOKENS, '{"option_id":"x"}', "OPTION 1: ", "\x00", "Ġ", "Ċ",
]
PIECE = st.one_of(
    st.sampled_from(SAMPLES),
    st.text(max_size=6),
    st.characters(categories=("Mn", "Mc", "Nd", "Zs", "Cc", "So", "Lo")),
    st.text(st.sampled_from(" \t\n\r\u00a0"), min_size=1, max_size=6),
    st.integers(min_value=0).map(str),
)
TEXTS = st.lists(PIECE, max_size=12).map("".join)


@settings(max_examples=TEXT_EXAMPLES, **FIXED)
@given(text=TEXTS)
def test_random_text_tokenizes_and_decodes_alike(original, rebuilt, text):
    _assert_alike(original, rebuilt, text)
    nfd = unicodedata.normalize("NFD", text)
    _assert_alike(original, rebuilt, nfd)


@settings(max_examples=ID_EXAMPLES, **FIXED)
@given(data=st.data())
def test_random_ids_decode_alike(original, rebuilt, data):
    n = original.get_vocab_size(with_added_tokens=True)
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=n - 1), max_size=24))
    for skip in (False, True):
        assert rebuilt.decode(ids, skip_special_tokens=skip) == \
            original.decode(ids, skip_special_tokens=skip)


# --------------------------------------------------------------------------- convert split

def test_split_without_tokenizer_decides_like_the_release(native, tiny_model_dir, original,
                                                          tmp_path):
    copied = split_native(native, tmp_path / "copied", tokenizer=tiny_model_dir / files.TOKENIZER)
    rebuilt_dir = split_native(native, tmp_path / "rebuilt")
    manifest = files.read_manifest(rebuilt_dir)
    assert manifest["tokenizer"] == files.TOKENIZER
    assert manifest["source"]["tokenizer"] == "gguf"
    written = tokenizers.Tokenizer.from_file(str(rebuilt_dir / files.TOKENIZER))
    assert written.get_vocab(with_added_tokens=True) == original.get_vocab(with_added_tokens=True)
    _assert_decides_alike(copied, rebuilt_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copied", "rebuilt"]  # no stage left


def test_split_into_an_existing_directory_keeps_other_files(native, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / files.MANIFEST).write_text("{}")  # a stale manifest is replaced, not kept
    split_native(native, out)
    assert files.read_manifest(out)["tokenizer"] == files.TOKENIZER
    assert {p.name for p in out.iterdir()} == {"notes.txt", "tower-f32.gguf", files.HEAD_WEIGHTS,
                                               files.HEAD_CONFIG, files.TOKENIZER, files.MANIFEST}
    assert (out / "notes.txt").read_text() == "mine"


def test_cli_says_the_tokenizer_is_rebuilt(native, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_split_arguments(parser)
    assert "rebuilt from the GGUF" in " ".join(parser.format_help().split())
    assert run_split(parser.parse_args([str(native), str(tmp_path / "out")])) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["manifest"] and summary["tokenizer"] == "rebuilt from the GGUF"


def test_a_failure_while_writing_leaves_nothing(native, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(split_module.files, "write_manifest", boom)
    with pytest.raises(OSError, match="disk full"):
        split_native(native, tmp_path / "new" / "out")
    assert list(tmp_path.iterdir()) == []  # neither out, nor its parent, nor the staging dir
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="disk full"):
        split_native(native, kept)
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


# --------------------------------------------------------------------------- refusals

def _rewrite(src, dst, edits: dict):
    """Copy a GGUF with keys replaced ((value, type, sub_type)) or dropped (None)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key not in edits:
            _copy_field(writer, key, field)
        elif edits[key] is not None:
            value, vtype, sub = edits[key]
            writer.add_key_value(key, value, vtype, sub_type=sub)
    for key, edit in edits.items():
        if key not in reader.fields and edit is not None:
            writer.add_key_value(key, edit[0], edit[1], sub_type=edit[2])
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _vocab(native):
    reader = gguf.GGUFReader(native)
    return (reader.fields["tokenizer.ggml.tokens"].contents(),
            reader.fields["tokenizer.ggml.token_type"].contents(),
            reader.fields["tokenizer.ggml.merges"].contents())


def _tokens(values):
    return values, gguf.GGUFValueType.ARRAY, STR


def _types(values):
    return values, gguf.GGUFValueType.ARRAY, I32


def _edits(native) -> dict[str, tuple[dict, str]]:
    tokens, types, merges = _vocab(native)
    pad = len(tokens) - 1  # the last row is a [PAD] the converter added
    retyped = lambda i, kind: _types(types[:i] + [int(kind)] + types[i + 1:])  # noqa: E731
    renamed = lambda i, text: _tokens(tokens[:i] + [text] + tokens[i + 1:])  # noqa: E731
    return {
        "pre": ({"tokenizer.ggml.pre": ("llama-bpe", STR, None)}, "ggml.pre is 'llama-bpe'"),
        "model": ({"tokenizer.ggml.model": ("llama", STR, None)}, "ggml.model is 'llama'"),
        "no merges": ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
        "no types": ({"tokenizer.ggml.token_type": None}, "tokenizer.ggml.token_type is missing"),
        "short types": ({"tokenizer.ggml.token_type": _types(types[:-1])}, "entries"),
        "bad merge": ({"tokenizer.ggml.merges": _tokens(merges + ["zq xj"])},
                      rf"merges\[{len(merges)}\] = 'zq xj' needs 'zq'"),
        "unused token": ({"tokenizer.ggml.token_type": retyped(5, gguf.TokenType.UNUSED)},
                         r"token_type\[5\] is UNUSED"),
        "byte token": ({"tokenizer.ggml.token_type": retyped(5, gguf.TokenType.BYTE)}, "BYTE"),
        "twice": ({"tokenizer.ggml.tokens": renamed(pad, "<|im_end|>"),
                   "tokenizer.ggml.token_type": retyped(pad, gguf.TokenType.CONTROL)}, "twice"),
        # An added token after a padding gap: HF would number it right after the others.
        "gap": ({"tokenizer.ggml.tokens": renamed(pad, "<extra>"),
                 "tokenizer.ggml.token_type": retyped(pad, gguf.TokenType.USER_DEFINED)},
                "numbers '<extra>'"),
        "add bos": ({"tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL, None)},
                    "add_bos_token is true"),
    }


CASES = ["pre", "model", "no merges", "no types", "short types", "bad merge", "unused token",
         "byte token", "twice", "gap", "add bos"]


@pytest.mark.parametrize("case", CASES)
def test_unrebuildable_vocabulary_is_refused_before_writing(native, tmp_path, case):
    edits, match = _edits(native)[case]
    bad = _rewrite(native, tmp_path / "bad.gguf", edits)
    if case == "gap":  # every key is consistent; only the ids HF would assign give it away
        tokenizer_spec(open_gguf(bad))
    with pytest.raises(ConversionError, match=match):
        tokenizer_from_gguf(open_gguf(bad))
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        split_native(bad, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]

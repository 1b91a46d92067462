"""The hardened GGUF reader (clef_gguf/formats/gguf.py) on files written here with gguf-py: what it
reads, and each way a file can be damaged, refused naming the field."""

import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from clef_gguf.core import errors
from clef_gguf.formats.gguf import (MISSING_TYPES, SKIM_ITEMS, array_length, check_header, ensure_gguf_types,
                                    field_value, file_type_name, ggml_to_float, open_gguf, string_items)

T = gguf.GGMLQuantizationType
HIDDEN, VOCAB, INNER = 32, 16, 64
# The fixed part of a GGUF header: magic, version, tensor count (u64 at 8), key/value count (u64 at 16).
TENSOR_COUNT, KV_COUNT = 8, 16


def write(path, tensors, kv=None, file_type=None):
    w = gguf.GGUFWriter(str(path), "qwen35")
    if file_type is not None:
        w.add_file_type(file_type)
    for key, (value, kind) in (kv or {}).items():
        w.add_key_value(key, value, kind)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def table():
    return np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32)


@pytest.fixture
def good(tmp_path, table):
    return write(tmp_path / "m.gguf", {"output.weight": table}, file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)


def _patched(path, out, offset, value):
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", value)
    out.write_bytes(bytes(data))
    return out


def test_a_good_file_reads(good, table):
    reader = open_gguf(good)
    assert [t.name for t in reader.tensors] == ["output.weight"]
    assert np.array_equal(np.asarray(reader.tensors[0].data), table)
    assert field_value(reader, "general.architecture") == "qwen35"
    assert field_value(reader, "no.such.key", default=7) == 7
    assert file_type_name(reader) == "q4_k_m"


def test_file_type_name_without_or_with_an_unknown_type(tmp_path, table):
    assert file_type_name(open_gguf(write(tmp_path / "a.gguf", {"output.weight": table}))) == "unknown"
    odd = write(tmp_path / "b.gguf", {"output.weight": table},
                kv={"general.file_type": (9999, gguf.GGUFValueType.UINT32)})
    assert file_type_name(open_gguf(odd)) == "ftype_9999"


@pytest.mark.parametrize("keep", [0, 3, 20, 0.5, 0.99])
def test_a_truncated_file_is_corrupt_naming_the_field(good, tmp_path, keep):
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(errors.CorruptModel, match="cut.gguf is not a readable GGUF file: ") as caught:
        open_gguf(cut, field="adapter")
    assert caught.value.field == "adapter"


def test_a_foreign_file_is_corrupt(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(errors.CorruptModel) as caught:
        open_gguf(junk)
    assert caught.value.field == "tower" and "junk.gguf" in caught.value.message


@pytest.mark.parametrize("offset, value, why", [(KV_COUNT, 2**40, "metadata entries cannot fit"),
                                                 (TENSOR_COUNT, 2**40, "tensor entries cannot fit"),
                                                 (KV_COUNT, 2**64 - 1, "metadata entries cannot fit")])
def test_counts_past_the_file_are_refused_at_once(good, tmp_path, offset, value, why):
    bad = _patched(good, tmp_path / "bad.gguf", offset, value)
    with pytest.raises(errors.CorruptModel, match=why):
        open_gguf(bad)


def test_a_file_that_ends_inside_the_tensor_data_is_refused(good, tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(good.read_bytes()[:-64])  # the header is whole; the tensor's data is not
    with pytest.raises(errors.CorruptModel, match="the file ends inside the field"):
        open_gguf(short)


def test_misaligned_tensor_data_is_refused(good, tmp_path):
    field = gguf.GGUFReader(good).tensors[0].field  # name, dims, type, then the data offset (u64)
    at = int(field.offset + sum(int(p.nbytes) for p in field.parts[:-1]))
    with pytest.raises(errors.CorruptModel, match="misaligned"):
        open_gguf(_patched(good, tmp_path / "odd.gguf", at, 1))


def test_text_metadata_that_is_not_utf8_is_refused(tmp_path, table):
    path = write(tmp_path / "t.gguf", {"output.weight": table},
                 kv={"general.name": ("clef-tiny", gguf.GGUFValueType.STRING)})
    data = path.read_bytes()
    bad = tmp_path / "u.gguf"
    bad.write_bytes(data.replace(b"clef-tiny", b"clef\xff\xfeny", 1))
    with pytest.raises(errors.CorruptModel, match="not a readable GGUF file"):
        open_gguf(bad)


def test_a_missing_file_or_a_directory_is_not_found_naming_the_field(tmp_path):
    for path in (tmp_path / "absent.gguf", tmp_path):
        with pytest.raises(errors.ModelNotFound, match="GGUF file not found") as caught:
            open_gguf(path, field="tower")
        assert caught.value.field == "tower"


# ---------------------------------------------------------------- the qwen35 header
def _qwen35(path, blocks=1, inner=INNER, eps=1e-6):
    kv = {"qwen35.block_count": (blocks, gguf.GGUFValueType.UINT32),
          "qwen35.embedding_length": (HIDDEN, gguf.GGUFValueType.UINT32),
          "qwen35.ssm.inner_size": (inner, gguf.GGUFValueType.UINT32),
          "qwen35.attention.layer_norm_rms_epsilon": (eps, gguf.GGUFValueType.FLOAT32)}
    tensors = {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32),
               "blk.0.ssm_out.weight": np.zeros((HIDDEN, INNER), np.float32)}
    return write(path, tensors, kv)


def test_a_consistent_qwen35_header_passes(tmp_path):
    path = _qwen35(tmp_path / "q.gguf")
    check_header(open_gguf(path), path)


@pytest.mark.parametrize("change, why", [({"blocks": 2}, "block_count is 2"),
                                         ({"inner": 48}, "ssm.inner_size 48"),
                                         ({"eps": 0.0}, "layer_norm_rms_epsilon is 0.0")])
def test_a_qwen35_header_llama_cpp_would_abort_on_is_refused(tmp_path, change, why):
    path = _qwen35(tmp_path / "q.gguf", **change)
    with pytest.raises(errors.CorruptModel, match=why) as caught:
        check_header(open_gguf(path), path)
    assert caught.value.field == "tower"


# ---------------------------------------------------------------- long metadata arrays (a vocabulary)
LONG = SKIM_ITEMS * 3


def _vocab(path, tokens):
    kv = {"tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY),
          "tokenizer.ggml.token_type": ([1] * len(tokens), gguf.GGUFValueType.ARRAY),
          "tokenizer.ggml.merges": (["a b", "c d"], gguf.GGUFValueType.ARRAY)}
    return write(path, {"output.weight": np.zeros((VOCAB, HIDDEN), np.float32)}, kv)


def test_a_long_array_is_located_not_read_and_reads_the_same_when_asked(tmp_path):
    tokens = [f"tok{i}" + "é" * (i % 3) for i in range(LONG)]
    path = _vocab(tmp_path / "v.gguf", tokens)
    skimmed, whole = open_gguf(path), open_gguf(path, whole_arrays=True)
    assert set(skimmed.skimmed) == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}  # short ones are read
    assert skimmed.fields["tokenizer.ggml.tokens"].data == []
    assert len(whole.fields["tokenizer.ggml.tokens"].data) == LONG
    for reader in (skimmed, whole):
        assert array_length(reader, "tokenizer.ggml.tokens") == LONG
        assert array_length(reader, "tokenizer.ggml.token_type") == LONG
        assert array_length(reader, "tokenizer.ggml.merges") == 2 and array_length(reader, "no.such") is None
        assert string_items(reader, "tokenizer.ggml.tokens") == [t.encode() for t in tokens]
        assert string_items(reader, "tokenizer.ggml.merges") == [b"a b", b"c d"]
    assert [t.name for t in skimmed.tensors] == ["output.weight"]  # what follows the arrays is where it was


def test_a_long_array_cut_short_or_overrunning_is_corrupt(tmp_path):
    path = _vocab(tmp_path / "v.gguf", [f"tok{i}" for i in range(LONG)])
    data = path.read_bytes()
    start = data.index(b"tok0") - 8  # the first string's length
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:start + 4000])
    overrun = _patched(path, tmp_path / "overrun.gguf", start + 8 * 1000 + sum(len(f"tok{i}") for i in range(1000)),
                       1 << 40)
    for bad in (cut, overrun):
        with pytest.raises(errors.CorruptModel) as caught:
            open_gguf(bad)
        assert caught.value.field == "tower"


def test_a_vocabulary_holding_a_token_twice_is_refused_however_it_was_read(tmp_path):
    path = _qwen35(tmp_path / "q.gguf")
    dup = write(tmp_path / "dup.gguf", {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32),
                                        "blk.0.ssm_out.weight": np.zeros((HIDDEN, INNER), np.float32)},
                {"qwen35.block_count": (1, gguf.GGUFValueType.UINT32),
                 "qwen35.embedding_length": (HIDDEN, gguf.GGUFValueType.UINT32),
                 "qwen35.ssm.inner_size": (INNER, gguf.GGUFValueType.UINT32),
                 "qwen35.attention.layer_norm_rms_epsilon": (1e-6, gguf.GGUFValueType.FLOAT32),
                 "tokenizer.ggml.tokens": ([f"t{i}" for i in range(LONG)] + ["t7"], gguf.GGUFValueType.ARRAY)})
    check_header(open_gguf(path), path)
    for whole in (False, True):
        with pytest.raises(errors.CorruptModel, match="same token twice"):
            check_header(open_gguf(dup, whole_arrays=whole), dup)


# ---------------------------------------------------------------- ggml's types and dequantizer
def test_ggml_dequantizes_as_gguf_py_does(table):
    raw = gguf.quants.quantize(table, T.Q8_0)
    ours = ggml_to_float(raw, int(T.Q8_0), HIDDEN)
    assert np.allclose(ours, gguf.quants.dequantize(raw, T.Q8_0))


def test_the_enum_patch_is_applied_by_the_reader_not_by_an_import(good):
    # A fresh interpreter: gguf-py as shipped, after importing the reader and the row store, after a read.
    code = (f"import sys, gguf\nknown = lambda: all(v in gguf.GGMLQuantizationType._value2member_map_ "
            f"for v in {sorted(MISSING_TYPES)})\nshipped = known()\n"
            "import clef_gguf.formats.gguf as g, clef_gguf.pipeline.lexical\nimported = known()\n"
            "g.open_gguf(sys.argv[1])\nprint(shipped, imported, known())")
    out = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, check=True)
    shipped, imported, read = out.stdout.split()
    assert imported == shipped and read == "True"
    ensure_gguf_types()  # idempotent, and the members are whole enum members
    for value, name in MISSING_TYPES.items():
        member = T(value)
        assert member.name == name and T[name] is member and gguf.GGML_QUANT_SIZES[member][0] > 0

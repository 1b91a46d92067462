"""The one safetensors reader (clef_gguf/formats/safetensors.py): what it reads, and each way a file
can be damaged, refused as the caller's error class naming the field and the file."""

import json

import pytest
import torch
from safetensors.torch import save_file

from clef_gguf.core import errors
from clef_gguf.formats import safetensors as st
from clef_gguf.formats.safetensors import opened, read_header


@pytest.fixture
def path(tmp_path):
    out = tmp_path / "w.safetensors"
    save_file({"table": torch.arange(12, dtype=torch.float32).reshape(4, 3),
               "ids": torch.tensor([1, 2], dtype=torch.int64),
               "half": torch.ones(2, dtype=torch.bfloat16)}, str(out))
    return out


def test_header_names_shapes_and_dtypes(path):
    assert read_header(path, field="head_weights") == {
        "half": st.TensorInfo((2,), "BF16"), "ids": st.TensorInfo((2,), "I64"),
        "table": st.TensorInfo((4, 3), "F32")}


def test_tensors_and_rows_read(path):
    with opened(path, field="tower") as weights:
        assert sorted(weights.names()) == ["half", "ids", "table"] and "ids" in weights
        assert torch.equal(weights.tensor("table", check_finite=True), torch.arange(12.0).reshape(4, 3))
        assert torch.equal(weights.rows("table", [2, 0]), torch.tensor([[6.0, 7, 8], [0, 1, 2]]))
        assert weights.rows("table", []).shape == (0, 3)
        assert weights.info("ids") == st.TensorInfo((2,), "I64")


@pytest.mark.parametrize("keep", [0, 5, 8, 20, -1])
def test_a_truncated_file_is_the_callers_error_naming_field_and_file(path, keep):
    raw = path.read_bytes()
    path.write_bytes(raw[:keep])
    with pytest.raises(errors.CorruptModel, match="w.safetensors is not a readable safetensors file: ") as caught:
        read_header(path, field="head_weights")
    assert caught.value.field == "head_weights"


def test_a_bad_header_is_refused(path):
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    header["table"]["data_offsets"] = [0, 10**6]  # past the data
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])
    with pytest.raises(errors.CorruptModel, match="not a readable safetensors file") as caught:
        read_header(path, field="vision")
    assert caught.value.field == "vision"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(errors.CorruptModel, match="not a readable safetensors file"):
        read_header(path, field="vision")


def test_the_caller_chooses_the_error_class_and_the_message(path):
    path.write_bytes(b"garbage")
    with pytest.raises(errors.ConversionError) as caught:
        read_header(path, field="src", error=errors.ConversionError, unreadable="cannot read w.safetensors")
    assert caught.value.field == "src" and caught.value.message.startswith("cannot read w.safetensors: ")


def test_nan_or_infinity_is_refused_only_where_asked(tmp_path):
    path = tmp_path / "nan.safetensors"
    save_file({"ok": torch.ones(3), "bad": torch.tensor([1.0, float("nan")]),
               "inf": torch.tensor([float("inf")], dtype=torch.bfloat16),
               "f8": torch.tensor([float("nan")]).to(torch.float8_e4m3fn)}, str(path))
    with opened(path, field="adapter") as weights:
        assert weights.tensor("bad").isnan().any()  # not asked: read as stored
        weights.tensor("ok", check_finite=True)
        for name in ("bad", "inf", "f8"):
            with pytest.raises(errors.CorruptModel, match=f"nan.safetensors: tensor {name} contains NaN") as caught:
                weights.tensor(name, check_finite=True)
            assert caught.value.field == "adapter"


def test_a_name_the_file_lacks(path):
    with opened(path, field="tower") as weights:
        for read in (weights.tensor, weights.info, lambda n: weights.rows(n, [0])):
            with pytest.raises(errors.CorruptModel, match="w.safetensors has no tensor nope"):
                read("nope")


def test_a_row_past_the_end_is_refused(path):
    with opened(path, field="tower") as weights:
        with pytest.raises(errors.CorruptModel, match="cannot read rows of table"):
            weights.rows("table", [9])


def test_a_missing_file_or_a_directory_is_not_found_naming_the_field(tmp_path):
    with pytest.raises(errors.ModelNotFound, match="head weights not found: .*absent") as caught:
        read_header(tmp_path / "absent.safetensors", field="head_weights", kind="head weights")
    assert caught.value.field == "head_weights"
    with pytest.raises(errors.ModelNotFound, match="is a directory") as caught:
        opened(tmp_path, field="vision").__enter__()
    assert caught.value.field == "vision"


def test_a_panic_in_the_parser_is_mapped_an_interrupt_is_not(path, monkeypatch):
    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def panics(*_a, **_k):
        raise PanicException("index out of bounds")

    monkeypatch.setattr(st, "safe_open", panics)
    with pytest.raises(errors.CorruptModel, match="not a readable safetensors file: index out of bounds"):
        read_header(path, field="head_weights")

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "safe_open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        read_header(path, field="head_weights")

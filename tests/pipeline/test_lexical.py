"""Lexical rows straight from GGUF files written here with gguf-py, in several tensor types."""

import gguf
import numpy as np
import pytest

from clef_gguf.core import errors
from clef_gguf.formats.gguf import file_type_name, open_gguf
from clef_gguf.pipeline import lexical

T = gguf.GGMLQuantizationType
HIDDEN, VOCAB = 256, 40


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, T]]):
    w = gguf.GGUFWriter(str(path), "qwen35")
    for name, (data, qtype) in tensors.items():
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, data.astype(np.float32 if qtype == T.F32 else np.float16))
        else:
            packed = gguf.quants.quantize(data, qtype)
            w.add_tensor(name, packed, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def table():
    return np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32)


@pytest.mark.parametrize("qtype, tol", [(T.F32, 0), (T.F16, 1e-2), (T.BF16, 2e-2), (T.Q8_0, 3e-2),
                                        (T.Q4_0, 0.5), (T.Q5_1, 0.2)])
def test_rows_match_the_dequantized_table(tmp_path, table, qtype, tol):
    path = write_gguf(tmp_path / "m.gguf", {"output.weight": (table, qtype),
                                            "token_embd.weight": (table * 0, T.F32)})
    rows = lexical.LexicalRows(open_gguf(path))
    assert rows.tensor_name == "output.weight" and rows.hidden_size == HIDDEN
    ids = np.array([3, 7, 3, 39, 0])
    got = rows.rows(ids)
    assert got.shape == (5, HIDDEN) and got.dtype == np.float32
    assert np.abs(got - table[ids]).max() <= tol * np.abs(table).max() + 1e-7
    assert np.array_equal(got[0], got[2])  # repeated tokens: cached, identical


def test_tied_model_falls_back_to_token_embd(tmp_path, table):
    path = write_gguf(tmp_path / "tied.gguf", {"token_embd.weight": (table, T.F32)})
    rows = lexical.LexicalRows(open_gguf(path))
    assert rows.tensor_name == "token_embd.weight"
    assert np.array_equal(rows.rows(np.array([5])), table[[5]])


def test_ggml_dequantizer_fallback_matches_gguf_py(tmp_path, table, monkeypatch):
    path = write_gguf(tmp_path / "q.gguf", {"output.weight": (table, T.Q8_0)})
    expected = lexical.LexicalRows(open_gguf(path)).rows(np.arange(VOCAB))

    def refuse(*_a, **_k):
        raise NotImplementedError("pretend gguf-py lacks this type")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    got = lexical.LexicalRows(open_gguf(path)).rows(np.arange(VOCAB))
    assert np.array_equal(got, expected)


def test_only_requested_rows_are_materialised(tmp_path, table):
    path = write_gguf(tmp_path / "m.gguf", {"output.weight": (table, T.Q8_0)})
    rows = lexical.LexicalRows(open_gguf(path))
    rows.rows(np.array([1, 2, 2]))
    assert rows.cached.tolist() == [1, 2]


def test_the_store_is_bounded_and_evicts_the_least_recently_used(tmp_path, table):
    path = write_gguf(tmp_path / "m.gguf", {"output.weight": (table, T.Q8_0)})
    reader = open_gguf(path)
    full = lexical.LexicalRows(reader).rows(np.arange(VOCAB))  # capacity: the whole table
    small = lexical.LexicalRows(reader, max_bytes=3 * 4 * table.shape[1])
    assert small.capacity == 3
    assert np.array_equal(small.rows(np.array([4, 1, 4])), full[[4, 1, 4]])
    assert np.array_equal(small.rows(np.array([7])), full[[7]])
    assert small.cached.tolist() == [1, 4, 7]
    small.rows(np.array([1]))  # 1 is now the most recent, 4 the least
    assert np.array_equal(small.rows(np.array([9, 7])), full[[9, 7]])
    assert small.cached.tolist() == [1, 7, 9]
    # more distinct rows than the store holds: answered exactly, the store left as it was
    many = np.array([0, 2, 3, 5, 6, 2, 0])
    assert np.array_equal(small.rows(many), full[many])
    assert small.cached.tolist() == [1, 7, 9]
    rng = np.random.default_rng(0)
    for _ in range(50):  # random traffic never returns a wrong row
        ids = rng.integers(0, VOCAB, size=rng.integers(1, 4))
        assert np.array_equal(small.rows(ids), full[ids])
    assert len(small.cached) <= 3


@pytest.mark.parametrize("ids, named", [([VOCAB], VOCAB), ([3, -2, VOCAB + 5], -2)])
def test_out_of_range_token_is_an_error(tmp_path, table, ids, named):
    path = write_gguf(tmp_path / "m.gguf", {"output.weight": (table, T.F32)})
    rows = lexical.LexicalRows(open_gguf(path))
    with pytest.raises(errors.CorruptModel, match=f"token id {named} is outside"):
        rows.rows(np.array(ids))


def test_missing_lm_head_tensor(tmp_path, table):
    path = write_gguf(tmp_path / "none.gguf", {"blk.0.attn_norm.weight": (table[0], T.F32)})
    with pytest.raises(errors.CorruptModel, match="output.weight"):
        lexical.LexicalRows(open_gguf(path))


def test_truncated_and_foreign_files(tmp_path, table):
    path = write_gguf(tmp_path / "m.gguf", {"output.weight": (table, T.F32)})
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.CorruptModel):
        open_gguf(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(errors.CorruptModel):
        open_gguf(tmp_path / "junk.gguf")
    with pytest.raises(errors.ModelNotFound):
        open_gguf(tmp_path / "absent.gguf")


def test_file_type_name(tmp_path, table):
    w = gguf.GGUFWriter(str(tmp_path / "ft.gguf"), "qwen35")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tensor("output.weight", table)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert file_type_name(open_gguf(tmp_path / "ft.gguf")) == "q4_k_m"


class TableSource:
    """A row source over a float32 table ``[vocab, H]``, counting the rows it dequantizes."""

    tensor_name, type_name = "table", "F32"

    def __init__(self, table: np.ndarray):
        self.table, self.read = table, []
        self.vocab_size, self.hidden_size = table.shape

    def dequantize(self, ids: np.ndarray) -> np.ndarray:
        self.read.extend(int(i) for i in ids)
        return self.table[ids]


def test_the_store_holds_any_row_source(table):
    source = TableSource(table.astype(np.float32))
    store = lexical.RowStore(source, max_bytes=2 * 4 * table.shape[1])
    assert store.type_name == "F32" and store.capacity == 2
    assert np.array_equal(store.rows(np.array([3, 5, 3])), source.table[[3, 5, 3]])
    assert np.array_equal(store.rows(np.array([5])), source.table[[5]])
    assert source.read == [3, 5]  # each row dequantized once, then served from the store

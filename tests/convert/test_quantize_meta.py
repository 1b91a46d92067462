"""Metadata the quantizer hands llama.cpp as C strings of at most 127 bytes."""

import pytest

from clef_gguf.convert.quantize import _c_string


@pytest.mark.parametrize("text", ["plain.dat", "é" * 100, "数据" * 50, "a" * 126 + "é", "🦊" * 40])
def test_c_strings_are_cut_on_a_character_boundary(text):
    out = _c_string(text, 127)
    assert len(out) <= 127
    decoded = out.decode("utf-8")  # never half a character
    assert text.startswith(decoded)
    if len(text.encode()) <= 127:
        assert decoded == text
    else:
        assert len(out) > 127 - 4  # cut at the last whole character that fits

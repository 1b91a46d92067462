"""Cost measured while eval runs: rates, file sizes, the peak RSS sampler."""

from __future__ import annotations

import math
import mmap
import time

from clef_gguf.evaluate.cost import Cost, PeakRss, file_bytes


def test_rates_and_round_trip():
    c = Cost(100, 150, 1 << 20, 1.5, 2.0, 10, 5000)
    assert c.records_per_s == 5.0 and c.tokens_per_s == 2500.0
    assert Cost.from_dict(c.to_dict()) == c
    assert math.isnan(Cost(1, 1, 1, 0.0, 0.0, 0, 0).records_per_s)


def test_file_bytes_counts_directories_and_skips_missing(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y" * 5)
    assert file_bytes([tmp_path / "a", tmp_path / "d", tmp_path / "missing"]) == 15


def test_peak_rss_sees_memory_taken_inside_the_block():
    with PeakRss() as rss:
        before = rss.peak
        # A fresh anonymous mapping: pages malloc already holds (freed by earlier tests) could be
        # reused without the resident set growing.
        block = mmap.mmap(-1, 64 << 20)
        for offset in range(0, len(block), 4096):  # touch every page
            block[offset] = 1
        # The sampler thread must see it while it is held (on a busy machine it may take a while
        # to be scheduled): wait for it, boundedly, then free it; the peak must stay.
        deadline = time.monotonic() + 30
        while rss.peak < before + (48 << 20) and time.monotonic() < deadline:
            time.sleep(0.01)
        block.close()
    assert rss.peak >= before + (48 << 20)

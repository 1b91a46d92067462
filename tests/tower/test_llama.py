"""The llama.cpp bindings: no process-wide change on import, llama.cpp's log captured per call."""

import json
import subprocess
import sys
import threading

from clef_gguf.tower import llama
from clef_gguf.formats.files import from_directory

# Records llama_log_set / llama_backend_init calls made while clef_gguf's modules are imported, then
# those of the first tower load.
PROBE = """
import json, sys
import llama_cpp as ll
calls = []
for name in ("llama_log_set", "llama_backend_init"):
    real = getattr(ll, name)
    setattr(ll, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a))[1])
import clef_gguf, clef_gguf.tower.llama_tower, clef_gguf.runtime.model, clef_gguf.tower.llama
on_import = list(calls)
from clef_gguf.tower.llama_tower import Tower
with Tower.load(sys.argv[1], n_ctx=256, threads=1):
    pass
with Tower.load(sys.argv[1], n_ctx=256, threads=1):
    pass
print(json.dumps({"on_import": on_import, "after_loads": calls}))
"""


def test_importing_leaves_the_log_callback_and_the_backend_alone(tiny_model_dir):
    gguf = from_directory(tiny_model_dir).tower
    proc = subprocess.run([sys.executable, "-c", PROBE, str(gguf)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["on_import"] == []
    assert got["after_loads"] == ["llama_log_set", "llama_backend_init"]  # once, at the first load


def test_a_capture_holds_its_own_threads_lines_only():
    llama.ensure_backend()
    other: list = []

    def log_elsewhere() -> None:
        with llama.captured() as lines:
            llama._on_log(4, b"elsewhere\n", None)
        other.extend(lines)

    with llama.captured() as lines:
        llama._on_log(3, b"mine\n", None)
        thread = threading.Thread(target=log_elsewhere)
        thread.start()
        thread.join()
        llama._on_log(5, b" continued\n", None)  # a continuation keeps the previous line's level
    assert lines == [(3, "mine\n"), (3, " continued\n")]
    assert other == [(4, "elsewhere\n")]
    assert llama.errors_in(lines) == "mine; continued"


def test_each_context_reports_its_own_compute_buffer(tiny_model_dir):
    model = llama.LlamaModel(from_directory(tiny_model_dir).tower)
    try:
        small = llama.LlamaContext(model, 256, 64, 1)
        big = llama.LlamaContext(model, 1024, 512, 1)
        try:
            assert 0 < small.compute_bytes < big.compute_bytes
        finally:
            small.close()
            big.close()
    finally:
        model.close()


def test_the_attention_setting_is_a_table_lookup(tiny_model_dir, monkeypatch):
    model = llama.LlamaModel(from_directory(tiny_model_dir).tower)
    try:
        assert model.ftype == llama.ll.LLAMA_FTYPE_ALL_F32 and model.n_layer == 4
        assert model.attention() is llama.ATTENTION["exact-f32"]
        monkeypatch.setattr(model, "gpu_layers", -1)  # offloaded: not measured, llama.cpp's default
        assert model.attention() is llama.ATTENTION["default"]
        monkeypatch.undo()
        monkeypatch.setattr(llama, "ATTENTION_BY_WEIGHTS", {})
        assert model.attention() is llama.ATTENTION["default"]
        # without flash attention llama.cpp reserves the full f32 score matrix
        exact = llama.LlamaContext(model, 1024, 128, 1, attention=llama.ATTENTION["exact-f32"])
        plain = llama.LlamaContext(model, 1024, 128, 1)
        try:
            assert exact.compute_bytes > plain.compute_bytes
            assert exact.can_tap_layers and plain.attention is llama.ATTENTION["default"]
        finally:
            exact.close()
            plain.close()
    finally:
        model.close()


def _mapped(path) -> int:
    """Bytes of ``path``'s mappings resident in this process (``/proc/self/smaps``)."""
    from pathlib import Path

    target, total, inside = str(Path(path).resolve()), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if head and "-" in head[0] and head[0][0] in "0123456789abcdef" and len(head) >= 5:
                inside = len(head) == 6 and head[5].strip() == target
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_the_towers_mapped_pages_are_dropped_as_it_loads_and_only_read_ones_come_back(tmp_path):
    """llama.cpp reads the whole file in at load; the load drops this process's pages of it as it goes
    (they stay in the page cache). A decode maps back the weights it reads from the file, never the
    lm_head's: no token is an output, so its 65,536-row matmul (Clef-Flash: 248,320) never runs. On the
    ~110M random model, whose lm_head is a third of the file: the kernel maps pages around each one read,
    a few dozen KiB, far less than that."""
    import numpy as np
    import pytest

    from clef_gguf.convert.synthetic import big
    from clef_gguf.formats.gguf import open_gguf

    if not llama._MAPS.exists():
        pytest.skip("no /proc/self/maps on this system: nothing is dropped")
    big.build_random_model(tmp_path / "m", preset="small", outtype="q8_0")
    tower = from_directory(tmp_path / "m").tower
    output = next(t for t in open_gguf(tower).tensors if t.name == "output.weight")
    size = tower.stat().st_size
    assert output.n_bytes > size // 4
    model = llama.LlamaModel(tower)
    try:
        assert _mapped(tower) == 0  # dropped: the file was read in, the process keeps none of it
        ctx = llama.LlamaContext(model, 256, 64, 1)
        try:
            ctx.decode_tokens(np.arange(1, 40, dtype=np.int32))
            assert ctx.rows(39, model.n_embd).shape == (39, model.n_embd)
            read = _mapped(tower)
            assert 0 < read < size - int(output.n_bytes) + 4 * 1024 * 1024  # the lm_head stays out
            assert llama.drop_mapped(tower) >= size and _mapped(tower) == 0
        finally:
            ctx.close()
    finally:
        model.close()

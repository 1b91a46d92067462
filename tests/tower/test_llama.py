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

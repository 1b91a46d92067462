"""Shared fixtures: one random tiny Clef release per session, converted on demand.

``tiny_release``            the Hugging Face-format release (``build_release(preset="tiny", seed=0)``)
``tiny_model_dir_factory``  outtype -> converted clef-gguf model directory (each built once)
``tiny_model_dir``          the f32 conversion, what most tests load
``tiny_hf_hidden``          ids -> transformers ``last_hidden_state`` (float32) of the tiny release
``tiny_nvfp4_dir``          scheme (nvfp4a16 | nvfp4) -> the tiny release as an NVFP4 checkpoint
``tiny_fine_tunes``        {"a", "b"} -> two random fine-tunes of the f32 tiny model (``convert adapter``)
``machine_load``            the machine's load as every measurement reads it, quiet or ``.busy()`` on request

Building and converting the tiny release takes well under a second; don't mutate these
directories in tests, copy them first.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

# A Hugging Face home of the suite's own, set before anything imports huggingface_hub (it reads the
# variable once): what `pull`, `pick` and `tune` cached for the user never reaches a test.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="clef-gguf-tests-hf-")

TINY_SEED = 0

# The fast inner loop is `python -m pytest -m "not slow"`; CI runs everything. These modules are slow
# as a whole (each test starts processes, servers, browsers or Ray, or converts many files); single slow
# tests elsewhere carry @pytest.mark.slow themselves.
SLOW_MODULES = {
    "tests/nvfp4/test_backend.py": "loads and serves NVFP4 checkpoints in fp32 through transformers",
    "tests/convert/test_nvfp4_convert.py": "quantizes releases to NVFP4 and calibrates W4A4",
    "tests/convert/test_gguf_tokenizer.py": "random text through two tokenizers",
    "tests/bulk/test_bulk_resume.py": "kills and resumes batch subprocesses",
    "tests/bulk/test_bulk_ray.py": "starts Ray and Ray Serve",
    "tests/bulk/test_every_flag_ray.py": "starts Ray and Ray Serve with every load flag",
    "tests/server/test_server_soak.py": "thousands of requests",
    "tests/server/test_server_load.py": "64 clients, signals to real server processes",
    "tests/server/test_server_fuzz.py": "schemathesis over every endpoint",
    "tests/server/test_server_media_fuzz.py": "70 bad pictures through a serve process, 5 decide processes",
    "tests/test_cli_media.py": "one Python process per command",
    "tests/server/test_ui_browser.py": "headless Chromium against real servers",
    "tests/server/test_ui_evidence_browser.py": "headless Chromium against a real server: the evidence view",
    "tests/tools/test_bench.py": "benchmarks in alternating rounds",
    "tests/tools/test_bench_server.py": "a server under load",
    "tests/tools/test_versus_server.py": "upstream-style server processes",
    "tests/tools/test_parity.py": "transformers reference runs over every output type",
    "tests/test_corrupt_files.py": "hundreds of damaged files loaded in child processes",
    "tests/test_cli.py": "one Python process per command",
    "tests/agent/test_mcp_server.py": "MCP server processes, each answer checked against decide and serve processes",
    "tests/test_scripts.py": "the GPU check script in a subprocess",
    "tests/models/test_hub_decide.py": "a fake Hub server and a CLI download",
    "tests/models/test_hub_vision.py": "a fake Hub serving a sharded release; image decisions through it",
    "tests/runtime/test_finetune.py": "PEFT merges and transformers reference runs of fine-tunes",
    "tests/media/test_media_parity.py": "Cloudflare's reference with transformers' processor in a child process",
    "tests/media/test_processor.py": "transformers' processor in child processes",
    "tests/media/test_video_files.py": "video files through transformers' processor and the reference (children)",
}


def pytest_collection_modifyitems(config, items) -> None:
    root = Path(config.rootpath)
    stale = [name for name in SLOW_MODULES if not (root / name).exists()]
    assert not stale, f"SLOW_MODULES names modules that do not exist: {stale}"
    for item in items:
        if Path(item.fspath).resolve().relative_to(root).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory) -> Path:
    from clef_gguf.convert.synthetic.tiny import build_release

    return build_release(tmp_path_factory.mktemp("tiny-release"), preset="tiny", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_model_dir_factory(tiny_release, tmp_path_factory):
    from clef_gguf.convert.release import convert_release

    made: dict[str, Path] = {}

    def make(outtype: str = "f32") -> Path:
        if outtype not in made:
            out = tmp_path_factory.mktemp(f"tiny-{outtype}")
            made[outtype] = convert_release(tiny_release, out, outtype=outtype, name="clef-tiny-random")
        return made[outtype]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dir_factory) -> Path:
    return tiny_model_dir_factory("f32")


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_release):
    import transformers  # a test dependency: its absence must fail the run, not skip the parity tests
    import torch

    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tiny_release, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_hf_hidden(tiny_hf_model):
    import torch

    def hidden(ids) -> np.ndarray:
        x = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
        with torch.no_grad():
            out = tiny_hf_model.model.language_model(input_ids=x, use_cache=False)
        return out.last_hidden_state[0].float().numpy()

    return hidden


@pytest.fixture(scope="session")
def tiny_nvfp4_dir(tiny_release, tmp_path_factory):
    """scheme ("nvfp4a16" | "nvfp4") -> the tiny release quantized by ``convert.nvfp4`` (once each)."""
    from clef_gguf.convert.nvfp4 import quantize_release

    made: dict[str, Path] = {}

    def make(scheme: str) -> Path:
        if scheme not in made:
            out = tmp_path_factory.mktemp(f"tiny-{scheme}") / "model"
            made[scheme] = quantize_release(tiny_release, out, scheme=scheme, name=f"clef-tiny-{scheme}")
        return made[scheme]

    return make


@pytest.fixture(scope="session")
def tiny_fine_tunes(tiny_release, tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Two random fine-tunes (LoRA + retrained head, seeds 1 and 2) converted for the f32 tiny model."""
    from clef_gguf.convert.synthetic.finetune_demo import build_finetune_checkpoint
    from clef_gguf.convert.lora import convert_adapter

    root = tmp_path_factory.mktemp("fine-tunes")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        checkpoint = build_finetune_checkpoint(tiny_release, root / f"ckpt-{name}", seed=seed)
        out[name] = convert_adapter(checkpoint, root / name, base=tiny_model_dir, outtype="f32", name=name)
    return out


@pytest.fixture
def machine_load(monkeypatch):
    """The machine's load as every measurement reads it (``core.load.Meter``), quiet until the test says
    ``machine_load.busy()``: tests of what ``pick`` and ``tune`` do under load, on a machine under any load."""
    from clef_gguf.core import load
    from machine_helpers import MachineLoad

    machine = MachineLoad()
    monkeypatch.setattr(load, "Meter", machine.meter)
    return machine


@pytest.fixture
def fake_tower(tmp_path, monkeypatch):
    """A file named like a tower (what ``tune``'s store keys on), in a Hugging Face home of its own."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path = tmp_path / "tower.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path

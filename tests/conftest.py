"""Shared fixtures: one random tiny Clef release per session, converted on demand.

``tiny_release``            the Hugging Face-format release (``build_release(preset="tiny", seed=0)``)
``tiny_model_dir_factory``  outtype -> converted clef-gguf model directory (each built once)
``tiny_model_dir``          the f32 conversion, what most tests load
``tiny_hf_hidden``          ids -> transformers ``last_hidden_state`` (float32) of the tiny release
``tiny_nvfp4_dir``          scheme (nvfp4a16 | nvfp4) -> the tiny release as an NVFP4 checkpoint

Building and converting the tiny release takes well under a second; don't mutate these
directories in tests, copy them first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory) -> Path:
    from clef_gguf.convert.tiny import build_release

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

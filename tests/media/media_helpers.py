"""Pictures made in memory, and transformers' processor run as the reference in a child process."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

HERE = Path(__file__).parent
SHIM = HERE / "tv_shim"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def picture(width: int, height: int, seed: int = 0, mode: str = "RGB") -> PIL.Image.Image:
    """Smooth gradients plus noise: resizing artefacts show in every pixel."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    bands = len(mode)
    base = np.stack([(x * (7 + c) + y * (3 + 2 * c)) % 256 for c in range(bands)], axis=-1)
    noise = rng.integers(-40, 40, size=(height, width, bands))
    array = np.clip(base + noise, 0, 255).astype(np.uint8)
    if mode == "RGBA":
        array[..., 3] = rng.integers(0, 256, size=(height, width), dtype=np.uint8)
    return PIL.Image.fromarray(array, mode)


def encode(image: PIL.Image.Image, fmt: str = "PNG", **save: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_uri(width: int, height: int, seed: int = 0, mode: str = "RGB") -> str:
    return data_uri(encode(picture(width, height, seed, mode)))


def exif_rotated_jpeg(width: int, height: int, orientation: int = 6) -> bytes:
    """A JPEG stored sideways with an EXIF Orientation tag (6 = rotate 90 degrees clockwise to view)."""
    exif = PIL.Image.Exif()
    exif[0x0112] = orientation
    return encode(picture(width, height, 5), "JPEG", quality=90, exif=exif.tobytes())


def run_reference(release: Path, cases: list[dict[str, Any]], tmp: Path, save_to: Path | None = None,
                  real_torchvision: str | None = None) -> list[dict[str, Any]]:
    """Each case through transformers' Qwen3VLProcessor (torchvision backend via the shim); with
    ``save_to``, the processor as transformers saves it too; with ``real_torchvision`` (an unpacked
    torchvision wheel), that torchvision's own transforms instead of the shim's."""
    import torch

    cases_path, out_path = tmp / "cases.json", tmp / "reference.pt"
    cases_path.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]),
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    env.pop("CLEF_REAL_TORCHVISION", None)
    if real_torchvision:
        env["PYTHONPATH"], env["CLEF_REAL_TORCHVISION"] = os.environ.get("PYTHONPATH", ""), real_torchvision
    subprocess.run([sys.executable, str(HERE / "reference_processor.py"), str(release), str(cases_path),
                    str(out_path), *([str(save_to)] if save_to else [])], check=True, env=env, cwd=tmp, timeout=600)
    return torch.load(out_path, weights_only=True)


def run_reference_decide(release: Path, requests: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """Each request answered by the reference (``reference_decide.py``) on ``release``."""
    import torch

    requests_path, out_path = tmp / "requests.json", tmp / "decided.pt"
    requests_path.write_text(json.dumps(requests))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]),
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, str(HERE / "reference_decide.py"), str(release), str(requests_path),
                    str(out_path)], check=True, env=env, cwd=tmp, timeout=600)
    return torch.load(out_path, weights_only=True)


NEVER_WAITS_S = 60.0  # far past any refusal, on any load; a read of a pipe with no writer never ends


def refusal(call: Any, kind: type, field: str) -> Exception:
    """What ``call()`` raises, which must be ``kind`` naming ``field``; run in a thread of its own so
    that a read that waits on its file (a pipe, a device) fails the test instead of hanging it."""
    import threading

    import pytest

    caught: list[BaseException] = []

    def attempt() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            caught.append(exc)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(NEVER_WAITS_S)
    assert not thread.is_alive(), f"still waiting after {NEVER_WAITS_S:g} s: a refusal must not wait on the file"
    if not caught:
        pytest.fail(f"expected {kind.__name__}, nothing was raised")
    if not isinstance(caught[0], kind):
        raise caught[0]
    assert getattr(caught[0], "field", None) == field
    return caught[0]

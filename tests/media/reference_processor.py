"""Child process: transformers' own Qwen3VLProcessor (torchvision backend through ``tv_shim``) as the reference.

``python reference_processor.py RELEASE CASES.json OUT.pt [SAVE_DIR]``: each case is
``{"text": str, "images": [str] | null, "videos": [[[str]]] | [path] | null, "kwargs": {...}}`` and the output is a
list of dicts of tensors (``input_ids``, ``pixel_values``, ``image_grid_thw``, ...). Run with the shim on
``PYTHONPATH`` (``media_helpers.run_reference``); never imported by the test process. With SAVE_DIR the
processor is also saved there (``save_pretrained``: the nested ``processor_config.json`` layout). With
``CLEF_REAL_TORCHVISION`` naming an unpacked torchvision wheel, its own transforms run instead of the shim's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch


def _real_torchvision(directory: str) -> None:
    """Import an unpacked torchvision wheel whose C++ ops do not load beside this torch (a CUDA build):
    its Python transforms (resize, normalize) run as they are; its decoder is the shim's (Pillow)."""
    sys.path.insert(0, directory)
    register_fake = torch.library.register_fake
    torch.library.register_fake = lambda *args, **kwargs: (lambda fn: fn)  # type: ignore[assignment]
    try:
        import torchvision
        import torchvision.io
    finally:
        torch.library.register_fake = register_fake
    assert torchvision.__file__.startswith(directory), torchvision.__file__
    spec = importlib.util.spec_from_file_location("tv_shim_io", Path(__file__).parent / "tv_shim/torchvision/io.py")
    assert spec is not None and spec.loader is not None
    shim_io = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim_io)
    torchvision.io.decode_image = lambda source, mode=None, apply_exif_orientation=False: shim_io.decode_image(
        source, shim_io.ImageReadMode.RGB, apply_exif_orientation)


def use_pyav() -> None:
    """Video files through transformers' PyAV loader: the processor asks for torchcodec, which does
    not load beside the CPU torch here (its fallback, torchvision's decoder, is gone from 0.26 on);
    ``load_video(..., backend="pyav")`` decodes the same FFmpeg frames."""
    import transformers.video_processing_utils as vpu
    from transformers import video_utils

    load = video_utils.load_video
    vpu.is_torchcodec_usable = lambda **_: True
    vpu.load_video = lambda video, backend=None, **kwargs: load(video, backend="pyav", **kwargs)


def main() -> None:
    release, cases_path, out_path, *save_dir = sys.argv[1:]
    use_pyav()
    if os.environ.get("CLEF_REAL_TORCHVISION"):
        _real_torchvision(os.environ["CLEF_REAL_TORCHVISION"])
    else:
        import torchvision  # the shim; a real torchvision here would mean the test is not isolated

        assert "tv_shim" in torchvision.__file__, torchvision.__file__
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(release)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    results = []
    for case in json.loads(open(cases_path).read()):
        try:
            out = processor(text=[case["text"]], images=case.get("images"), videos=case.get("videos"),
                            return_tensors="pt", **case.get("kwargs", {}))
            results.append({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
        except Exception as exc:  # the reference's refusal, compared by the test
            results.append({"error": repr(exc)})
    torch.save(results, out_path)
    if save_dir:
        processor.save_pretrained(save_dir[0])


if __name__ == "__main__":
    main()

"""Every load flag with a value that differs from its default and works on the tiny model, and what
each must have changed in the loaded model (``info``, as ``/v1/models`` also shows it)."""

from __future__ import annotations

from pathlib import Path

from clef_gguf.formats import calibration as cal


def calibration_for(model_dir: Path, out: Path) -> cal.Calibration:
    """A calibration bound to the tiny model's base (written to ``out``)."""
    from clef_gguf.runtime.model import Clef

    with Clef.load(model_dir, threads=1) as clef:
        bound = cal.binding(clef.files, clef.provenance.model_hash, clef.provenance.template_sha256)
    c = cal.Calibration.build({"bound_to": bound, "temperatures": {
        "noul": {"temperature": 2.0, "source": "type", "n": 30}}})
    c.write(out)
    return c


def every_flag(model_dir: Path, fine_tune: Path, calibration: Path) -> dict[str, list[str]]:
    """settings field -> its flags on the command line (one entry per field of LoadSettings)."""
    d = Path(model_dir)
    return {"model": ["--model", str(d)], "backend": ["--backend", "gguf"],
            "gguf": ["--gguf", str(d / "tower-f32.gguf")], "head": ["--head", str(d / "joint_head.safetensors")],
            "head_config": ["--head-config", str(d / "joint_head_config.json")],
            "tokenizer": ["--tokenizer", str(d / "tokenizer.json")],
            "threads": ["--threads", "1"], "head_threads": ["--head-threads", "2"], "gpu_layers": ["--gpu-layers", "0"],
            "max_length": ["--max-length", "1024"], "head_dtype": ["--head-dtype", "bf16"],
            "head_device": ["--head-device", "cpu"], "nvfp4_dtype": ["--nvfp4-dtype", "auto"],
            "allow_download": ["--offline"], "state_cache_mb": ["--state-cache-mb", "7"],
            "vision_cache_mb": ["--vision-cache-mb", "5"], "vision_engine": ["--vision-engine", "int8"],
            "strict": ["--strict"], "decode_chunk": ["--decode-chunk", "256"],
            "flash_attention": ["--flash-attention", "on"], "pack_size": ["--pack-size", "2"], "tune": ["--no-tune"],
            "calibration": ["--calibration", str(calibration)], "adapters": ["--adapter", f"ft={fine_tune}"]}


def argv(flags: dict[str, list[str]]) -> list[str]:
    return [word for words in flags.values() for word in words]


def expected_info(version: str, *, threads: int = 1) -> dict:
    """What ``every_flag`` must have made of the default model's ``info``."""
    return {"threads": threads, "head_threads": 2, "gpu_layers": 0, "max_length": 1024, "head_dtype": "bf16",
            "head_device": "cpu",
            "state_cache_mb": 7.0, "vision_cache_mb": 5.0, "vision_engine": "int8", "strict": True,
            "calibration_version": version, "backend": "llama-cpp-python", "attention": "flash-on", "tuned": {}}

"""Images and videos end to end against Cloudflare's reference: the same prompt ids (so
``usage.input_tokens`` is the reference's), and the same probabilities (f32 max |dp| <= 2e-3, argmax
equal where the reference's margin > 0.01), through ``Clef`` on the converted tiny release."""

from __future__ import annotations

import numpy as np
import pytest

from clef_gguf import Clef
from media_helpers import png_uri, run_reference_decide

QUESTIONS = {"cat": {"type": "noul", "instructions": "Is there a cat?"},
             "color": {"type": "choice", "criteria": {"red": None, "green": "Mostly green", "blue": None}},
             "busy": {"type": "score", "criteria": ["calm", "busy", "chaotic"]}}
JSON_STATE = {"ticket": 48213, "text": "Photo attached", "amount": 19.99}


def _requests() -> list[dict]:
    video = [[png_uri(32, 24, seed) for seed in range(10, 14)]]  # 4 frames: 2 temporal pairs
    return [
        {"model": "m", "state": "One small image.", "images": [png_uri(16, 16, 1)], "questions": QUESTIONS},
        {"model": "m", "state": "A wide one.", "images": [png_uri(56, 24, 2)], "questions": QUESTIONS},
        {"model": "m", "state": "A tall one that resizes.", "images": [png_uri(40, 100, 3)], "questions": QUESTIONS},
        {"model": "m", "state": "Two images.", "images": [png_uri(24, 32, 4), png_uri(48, 16, 5)],
         "questions": QUESTIONS},
        {"model": "m", "state": JSON_STATE, "images": [png_uri(32, 32, 6)], "questions": QUESTIONS},
        {"model": "m", "state": "A clip.", "videos": [video], "media_kwargs": {"do_sample_frames": False},
         "questions": QUESTIONS},
        {"model": "m", "state": "A smaller budget.", "images": [png_uri(64, 64, 7)],
         "media_kwargs": {"size": {"shortest_edge": 256, "longest_edge": 1024}}, "questions": QUESTIONS},
    ]


@pytest.fixture(scope="module")
def reference(tiny_release, tmp_path_factory):
    return run_reference_decide(tiny_release, _requests(), tmp_path_factory.mktemp("reference"))


def test_media_answers_match_the_reference(tiny_model_dir, reference):
    worst = 0.0
    with Clef.load(tiny_model_dir, state_cache_mb=0) as clef:
        for request, ref in zip(_requests(), reference):
            assert "error" not in ref, ref
            prepared = clef.prepare(request)
            assert prepared.encoded.ids.tolist() == ref["input_ids"].tolist()
            assert clef.decide(request)["usage"]["input_tokens"] == len(ref["input_ids"])
            ours = clef.probabilities(request)
            for got, want in zip(ours, ref["probs"]):
                want = want.numpy()
                worst = max(worst, float(np.abs(got - want).max()))
                top = np.sort(want)[::-1]
                if top[0] - top[1] > 0.01:
                    assert int(np.argmax(got)) == int(np.argmax(want))
        # Another picture moves the answers far more than that: the pixels really reach the tower.
        other = dict(_requests()[4], images=[png_uri(32, 32, 99)])
        moved = max(float(np.abs(a - b).max()) for a, b in zip(clef.probabilities(other), ours_of(clef, 4)))
    print(f"\nmedia vs reference: max |dp| {worst:.2e} over {len(reference)} requests; another picture: {moved:.2e}")
    assert worst <= 2e-3 and moved > 50 * worst


def ours_of(clef: Clef, i: int) -> list[np.ndarray]:
    return clef.probabilities(_requests()[i])


def test_text_only_answers_are_unchanged_by_the_vision_part(tiny_model_dir, tmp_path):
    """A model directory without its vision files answers text exactly as with them."""
    import shutil

    text_only = shutil.copytree(tiny_model_dir, tmp_path / "m")
    for name in ("vision.safetensors", "vision_config.json"):
        (text_only / name).unlink()
    request = {"state": "No pictures.", "questions": QUESTIONS}
    with Clef.load(tiny_model_dir) as seeing, Clef.load(text_only) as blind:
        assert seeing.decide(request)["answers"] == blind.decide(request)["answers"]
        with pytest.raises(Exception) as exc:
            blind.decide(dict(request, images=[png_uri(16, 16)]))
        assert getattr(exc.value, "code", None) == "unsupported" and exc.value.field == "images"


def test_the_nvfp4_backend_sees_the_same_pictures(tiny_model_dir, tiny_nvfp4_dir, tiny_release):
    """The nvfp4 checkpoint keeps the release's vision tensors: the same media prompt (ids, runs, M-RoPE
    positions) as the GGUF path, and its tower decodes it as transformers' model on the dequantized
    weights does, fed the same vision rows at the same positions."""
    import torch
    import transformers

    from clef_gguf.formats import files
    from clef_gguf.tower.nvfp4 import format as fmt
    from clef_gguf.tower.nvfp4.checkpoint import Checkpoint

    directory = tiny_nvfp4_dir("nvfp4a16")
    checkpoint = Checkpoint(directory / files.CHECKPOINT_CONFIG)
    ref = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tiny_release, dtype=torch.float32).eval()
    for name in checkpoint.quantized:
        ref.get_submodule(name).weight.data.copy_(fmt.dequantize_weight(
            checkpoint.tensor(f"{name}.weight_packed"), checkpoint.tensor(f"{name}.weight_scale"),
            checkpoint.tensor(f"{name}.weight_global_scale")))
    lm = ref.model.language_model
    with Clef.load(tiny_model_dir, state_cache_mb=0) as gguf, Clef.load(directory, state_cache_mb=0) as fp4:
        assert fp4.info["vision"] == "images, videos"
        for request in [_requests()[i] for i in (1, 3, 5)]:
            enc = fp4.prepare(request).encoded
            assert enc.ids.tolist() == gguf.prepare(request).encoded.ids.tolist()
            ours, _ = fp4.tower.forward(enc.ids, enc.prefix_tokens, enc.state_tokens, None, enc.media)
            media = enc.media
            with torch.no_grad():
                x = lm.embed_tokens(torch.as_tensor(enc.ids, dtype=torch.long)[None])
                at = 0
                for run in media.runs:
                    x[0, run.start:run.end] = torch.from_numpy(media.embed()[at:at + run.n_tokens])
                    at += run.n_tokens
                pos = torch.from_numpy(media.positions.astype(np.int64))[:, None, :]
                theirs = lm(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state[0].numpy()
            assert float(np.abs(ours - theirs).max()) < 2e-4 * max(1.0, float(np.abs(theirs).max()))

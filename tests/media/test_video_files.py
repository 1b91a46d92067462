"""Video files (a path or URL in ``videos``) decoded and sampled as the reference's processor does it.

Clips are made here with PyAV itself (mpeg4, libx264, VP9: several rates, lengths, sizes, an odd frame
count). Compared with transformers 5.23: the frames and metadata against its PyAV loader
(``video_utils.load_video(backend="pyav")``) with ``Qwen3VLVideoProcessor.sample_frames``, in this
process; the pixels, grids and prompt ids against its ``Qwen3VLProcessor``, and whole decisions against
Cloudflare's reference, in child processes (``media_helpers``). Then every bad file and the policy.
"""

from __future__ import annotations

import fractions
import http.server
import os
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from media_helpers import VIDEO, png_uri, refusal, run_reference, run_reference_decide
from tokenizers import Tokenizer

from clef_gguf import Clef
from clef_gguf.core import errors
from clef_gguf.media import (INLINE_ONLY, MediaPolicy, load_processor_config, load_video, parse_media_kwargs,
                             prepare_media)
from clef_gguf.media.config import video_settings
from clef_gguf.media import video_files
from clef_gguf.media.video_files import sample_indices

ANY = MediaPolicy(url_allow=("*",))


def clip(path: Path, frames: int, fps: float | fractions.Fraction, width: int, height: int, codec: str = "mpeg4",
         fmt: str | None = None, seed: int = 0, **options: str) -> Path:
    """A clip of moving gradients plus noise (every frame differs, resizing shows in every pixel)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            rgb = np.stack([(x * (3 + c) + y * (2 + c) + 11 * i) % 256 for c in range(3)], axis=-1)
            rgb = np.clip(rgb + rng.integers(-25, 25, rgb.shape), 0, 255).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("clips")
    return {
        "mpeg4 30 fps, 25 frames": clip(d / "a.mp4", 25, 30, 64, 48),
        "h264 5 fps, 7 frames": clip(d / "b.mp4", 7, 5, 50, 40, "libx264", seed=1),
        "mpeg4 24 fps, 61 frames, resizes": clip(d / "c.mp4", 61, 24, 96, 72, seed=2),
        "h264 25 fps, 3 frames": clip(d / "d.mov", 3, 25, 40, 40, "libx264", seed=3),
        "h264 12.5 fps, 31 frames": clip(d / "e.mp4", 31, fractions.Fraction(25, 2), 48, 64, "libx264", seed=4),
        "webm": clip(d / "f.webm", 10, 10, 64, 48, "libvpx-vp9", "webm", seed=5),
    }


# (clip, media_kwargs): the processor's default sampling (2 fps, at least 4 frames), another fps, every
# frame, a frame count, one that repeats frames (num_frames over the clip's frames).
CASES = [
    ("mpeg4 30 fps, 25 frames", {}),
    ("h264 5 fps, 7 frames", {}),
    ("mpeg4 24 fps, 61 frames, resizes", {}),
    ("h264 25 fps, 3 frames", {}),
    ("h264 12.5 fps, 31 frames", {}),
    ("mpeg4 30 fps, 25 frames", {"fps": 10}),
    ("mpeg4 24 fps, 61 frames, resizes", {"fps": 0.5}),
    ("h264 5 fps, 7 frames", {"do_sample_frames": False}),
    ("mpeg4 30 fps, 25 frames", {"num_frames": 6, "fps": None}),
    ("h264 25 fps, 3 frames", {"num_frames": 5, "fps": None}),
]
IDS = [f"{name} {kwargs}" for name, kwargs in CASES]


def _ours(release: Path, path: Path, kwargs: dict, policy: MediaPolicy = ANY):
    config = load_processor_config(release)
    options, warnings = parse_media_kwargs(kwargs)
    assert warnings == []
    video = load_video(str(path), policy, video_settings(config, options), "videos.0")
    return video, prepare_media([], [video], config, options)


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_frames_equal_transformers_pyav_loader(tiny_release, clips, name, kwargs):
    """The same indices as ``Qwen3VLVideoProcessor.sample_frames``, the same frames and metadata as
    ``load_video(backend="pyav")``: equal arrays, not close ones."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import load_video as reference_load

    config = load_processor_config(tiny_release)
    settings = video_settings(config, parse_media_kwargs(kwargs)[0])
    processor = SimpleNamespace(fps=2, min_frames=4, max_frames=768)  # the class defaults the release keeps
    fps = kwargs.get("fps", 2)
    sampler = None
    if kwargs.get("do_sample_frames", True):
        def sampler(metadata, **_):
            return Qwen3VLVideoProcessor.sample_frames(processor, metadata, num_frames=kwargs.get("num_frames"),
                                                       fps=fps)
    frames, metadata = reference_load(str(clips[name]), backend="pyav", sample_indices_fn=sampler)
    ours = load_video(str(clips[name]), ANY, settings, "videos.0")
    assert list(ours.indices) == [int(i) for i in metadata.frames_indices]
    assert (ours.fps, ours.total_frames, ours.duration) == (metadata.fps, metadata.total_num_frames, metadata.duration)
    reference = torch.from_numpy(frames).permute(0, 3, 1, 2)
    assert ours.frames.dtype == torch.uint8 and ours.frames.shape == reference.shape
    assert torch.equal(ours.frames, reference)
    assert sample_indices(metadata.total_num_frames, metadata.fps, settings) == list(ours.indices)


def _assert_processor_equal(release: Path, path: Path, kwargs: dict, ref: dict) -> None:
    assert "error" not in ref, ref.get("error")
    _, ours = _ours(release, path, kwargs)
    assert ours.videos is not None and ours.videos.pixel_values.shape == ref["pixel_values_videos"].shape
    assert torch.equal(ours.videos.pixel_values, ref["pixel_values_videos"])
    assert torch.equal(ours.videos.grid_thw, ref["video_grid_thw"])
    merge = load_processor_config(release).video.merge_size ** 2
    assert list(ours.video_tokens) == [int(g.prod()) // merge for g in ref["video_grid_thw"]]
    tokenizer = Tokenizer.from_file(str(release / "tokenizer.json"))
    assert tokenizer.encode(ours.text, add_special_tokens=False).ids == ref["input_ids"][0].tolist()


@pytest.fixture(scope="module")
def processor_reference(tiny_release, clips, tmp_path_factory):
    cases = [{"text": VIDEO + "\n", "videos": [str(clips[name])], "kwargs": kwargs} for name, kwargs in CASES]
    cases += [{"text": VIDEO + "\n", "videos": [str(clips["mpeg4 30 fps, 25 frames"])], "kwargs": kwargs}
              for kwargs in ({"num_frames": 6}, {"num_frames": 1, "fps": None})]
    cases.append({"text": VIDEO + "\n", "videos": [str(clips["webm"])], "kwargs": {}})
    return run_reference(tiny_release, cases, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_pixels_grids_and_prompt_equal_the_processor(tiny_release, clips, processor_reference, case):
    name, kwargs = CASES[case]
    _assert_processor_equal(tiny_release, clips[name], kwargs, processor_reference[case])


def test_the_processor_refusals_match(tiny_release, clips, processor_reference):
    """num_frames beside the release's fps, and a single sampled frame: refused by both."""
    path = clips["mpeg4 30 fps, 25 frames"]
    assert "mutually exclusive" in processor_reference[len(CASES)]["error"]
    with pytest.raises(errors.InvalidValue) as caught:
        _ours(tiny_release, path, {"num_frames": 6})
    assert caught.value.field == "media_kwargs.num_frames"
    assert "temporal_factor" in processor_reference[len(CASES) + 1]["error"]
    with pytest.raises(errors.InvalidMedia, match="at least 2 frames") as caught:
        _ours(tiny_release, path, {"num_frames": 1, "fps": None})
    assert caught.value.field == "videos.0"


def test_clef_flash_settings(tiny_release, clips, tmp_path):
    """At Clef-Flash's processor settings (patch 16: 32x32 pixels a token) a 160x90 clip resizes up."""
    import json
    import shutil

    from clef_gguf.convert.synthetic.tiny import TINY_IMAGE_PROCESSOR, TINY_VIDEO_PROCESSOR

    release = tmp_path / "qwen35"
    release.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_release / name, release / name)
    (release / "preprocessor_config.json").write_text(json.dumps(
        {**TINY_IMAGE_PROCESSOR, "patch_size": 16, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))
    (release / "video_preprocessor_config.json").write_text(json.dumps(
        {**TINY_VIDEO_PROCESSOR, "patch_size": 16, "size": {"shortest_edge": 4096, "longest_edge": 25165824}}))
    path = clip(tmp_path / "wide.mp4", 20, 8, 160, 90, "libx264", seed=5)
    ref = run_reference(release, [{"text": VIDEO + "\n", "videos": [str(path)], "kwargs": {}}], tmp_path)
    _assert_processor_equal(release, path, {}, ref[0])


# ------------------------------------------------------------------------ whole decisions
QUESTIONS = {"moving": {"type": "noul", "instructions": "Does something move?"},
             "color": {"type": "choice", "criteria": {"red": None, "green": "Mostly green", "blue": None}},
             "busy": {"type": "score", "criteria": ["calm", "busy", "chaotic"]}}


def _requests(clips: dict[str, Path]) -> list[dict]:
    a, c = str(clips["mpeg4 30 fps, 25 frames"]), str(clips["mpeg4 24 fps, 61 frames, resizes"])
    return [
        {"model": "m", "state": "A clip.", "videos": [a], "questions": QUESTIONS},
        {"model": "m", "state": "A picture and a longer clip.", "images": [png_uri(24, 32, 4)], "videos": [c],
         "media_kwargs": {"fps": 10}, "questions": QUESTIONS},
        {"model": "m", "state": "Every frame.", "videos": [str(clips["h264 5 fps, 7 frames"])],
         "media_kwargs": {"do_sample_frames": False}, "questions": QUESTIONS},
        {"model": "m", "state": "Two clips.", "videos": [str(clips["h264 12.5 fps, 31 frames"]), a],
         "questions": QUESTIONS},
    ]


def test_decisions_equal_the_reference(tiny_model_dir, tiny_release, clips, tmp_path):
    reference = run_reference_decide(tiny_release, _requests(clips), tmp_path)
    worst = 0.0
    with Clef.load(tiny_model_dir, state_cache_mb=0) as clef:
        for request, ref in zip(_requests(clips), reference):
            assert "error" not in ref, ref
            assert clef.prepare(request).encoded.ids.tolist() == ref["input_ids"].tolist()
            assert clef.decide(request)["usage"]["input_tokens"] == len(ref["input_ids"])
            for got, want in zip(clef.probabilities(request), ref["probs"]):
                worst = max(worst, float(np.abs(got - want.numpy()).max()))
    print(f"\nvideo files vs reference: max |dp| {worst:.2e} over {len(reference)} requests")
    assert worst <= 2e-3


# ------------------------------------------------------------------------ bad files, limits
def _refused(path: Path | str, kind: type, policy: MediaPolicy = ANY, release: Path | None = None,
             kwargs: dict | None = None, spent: int = 0) -> str:
    """The refusal's message: it names ``videos.0``."""
    settings = video_settings(load_processor_config(release), parse_media_kwargs(kwargs)[0]) if release else None
    return refusal(lambda: load_video(str(path), policy, settings, "videos.0", spent), kind, "videos.0").message


def _no_decoding(*_args, **_kwargs):
    """In place of the frame decoder where a refusal must come from the container's metadata alone (what
    a time bound meant to show, whatever the machine's load)."""
    raise AssertionError("a frame was decoded")


def test_corrupt_truncated_empty_and_not_video(tiny_release, clips, tmp_path):
    data = clips["mpeg4 30 fps, 25 frames"].read_bytes()
    cases = {"random.mp4": os.urandom(5000), "empty.mp4": b"", "cut.mp4": data[:len(data) // 2],
             "text.mp4": b"not a video at all\n" * 50}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        _refused(tmp_path / name, errors.InvalidMedia, release=tiny_release)
    # The index up front (faststart): it opens, and the sampled frames past the cut are missing.
    whole = clip(tmp_path / "fast.mp4", 20, 10, 64, 48, movflags="faststart").read_bytes()
    (tmp_path / "fast-cut.mp4").write_bytes(whole[:len(whole) // 2])
    assert "truncated" in _refused(tmp_path / "fast-cut.mp4", errors.InvalidMedia, release=tiny_release)
    # Garbage in the middle of the frames: FFmpeg conceals or fails, never hangs.
    (tmp_path / "holed.mp4").write_bytes(whole[:len(whole) // 3] + os.urandom(len(whole) // 3)
                                          + whole[2 * len(whole) // 3:])
    try:
        load_video(str(tmp_path / "holed.mp4"), ANY, video_settings(load_processor_config(tiny_release),
                                                                    parse_media_kwargs({})[0]), "videos.0")
    except errors.InvalidMedia as exc:
        assert exc.field == "videos.0"


def test_no_video_stream_or_no_frames(tiny_release, tmp_path):
    audio = tmp_path / "audio.m4a"
    with av.open(str(audio), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        for i in range(5):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    assert "no video stream" in _refused(audio, errors.InvalidMedia, release=tiny_release)
    empty = tmp_path / "empty.mp4"
    with av.open(str(empty), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        container.start_encoding()
    _refused(empty, errors.InvalidMedia, release=tiny_release)


def test_webm_has_no_frame_count_as_in_the_reference(tiny_release, clips, processor_reference):
    """WebM stores no frame count; transformers' PyAV loader then samples nothing and fails."""
    assert "frame count" in _refused(clips["webm"], errors.InvalidMedia, release=tiny_release)
    assert "IndexError" in processor_reference[len(CASES) + 2]["error"]


def test_huge_and_long_files_are_refused_by_their_metadata(tiny_release, tmp_path, monkeypatch):
    huge = tmp_path / "huge.mp4"
    with av.open(str(huge), "w") as container:  # one black 8192x8192 frame: 67 megapixels
        stream = container.add_stream("libx264", rate=1, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 8192, 8192, "yuv420p"
        container.mux(stream.encode(av.VideoFrame(8192, 8192, "yuv420p")))
        container.mux(stream.encode())
    monkeypatch.setattr(video_files, "_read_frames", _no_decoding)  # refused before any frame is decoded
    assert "8192x8192" in _refused(huge, errors.MediaTooLarge, release=tiny_release)
    long = clip(tmp_path / "long.mp4", 10, fractions.Fraction(1, 100), 32, 32)  # 10 frames, 100 s apart
    assert "1000.0 s" in _refused(long, errors.MediaTooLarge, release=tiny_release)


def test_the_policy_limits_are_named(tiny_release, clips):
    path = clips["mpeg4 24 fps, 61 frames, resizes"]
    message = _refused(path, errors.MediaTooLarge, replace(ANY, max_video_seconds=2), tiny_release)
    assert "2.5 s" in message and "limit of 2 s" in message
    message = _refused(path, errors.MediaTooLarge, replace(ANY, max_video_frames=60), tiny_release,
                       {"do_sample_frames": False})
    assert "61 frames" in message and "limit of 60 frames" in message
    message = _refused(path, errors.MediaTooLarge, replace(ANY, max_video_pixels=96 * 72 * 5 - 1), tiny_release)
    assert "5 frames of 96x72 pixels, over the budget of 34559 decoded video pixels" in message
    message = _refused(path, errors.MediaTooLarge, replace(ANY, max_video_pixels=96 * 72 * 5), tiny_release,
                       spent=96 * 72)  # what the request's earlier video files hold counts too
    assert "budget" in message
    message = _refused(path, errors.MediaTooLarge, replace(ANY, max_pixels=96 * 72 - 1), tiny_release)
    assert "96x72" in message
    assert "took over 0 s" in _refused(path, errors.MediaTooLarge, replace(ANY, video_decode_s=0), tiny_release)


def test_two_video_files_share_the_pixel_budget(tiny_model_dir, clips):
    a = str(clips["mpeg4 30 fps, 25 frames"])
    request = {"state": "x", "videos": [a, a], "questions": QUESTIONS}
    with Clef.load(tiny_model_dir, state_cache_mb=0) as clef:
        clef.prepare(request, media_policy=replace(ANY, max_video_pixels=64 * 48 * 8))
        with pytest.raises(errors.MediaTooLarge) as caught:
            clef.prepare(request, media_policy=replace(ANY, max_video_pixels=64 * 48 * 8 - 1))
    assert caught.value.field == "videos.1"


# ------------------------------------------------------------------------ where a video may come from
def test_a_server_policy_reads_only_inside_its_roots(tiny_release, clips, tmp_path):
    inside = tmp_path / "allowed"
    inside.mkdir()
    (inside / "a.mp4").write_bytes(clips["mpeg4 30 fps, 25 frames"].read_bytes())
    served = MediaPolicy(local_paths=True, file_roots=(inside.resolve(),))
    config = load_processor_config(tiny_release)
    settings = video_settings(config, parse_media_kwargs({})[0])
    assert load_video(str(inside / "a.mp4"), served, settings, "videos.0").frames.shape[0] == 4
    assert "--media-allow-files" in _refused(clips["mpeg4 30 fps, 25 frames"], errors.UnsupportedMediaSource,
                                            served, tiny_release)
    (inside / "link.mp4").symlink_to(clips["h264 5 fps, 7 frames"])
    _refused(inside / "link.mp4", errors.UnsupportedMediaSource, served, tiny_release)
    os.mkfifo(inside / "pipe.mp4")  # never opened for a blocking read
    _refused(inside / "pipe.mp4", errors.UnsupportedMediaSource, served, tiny_release)
    assert "not allowed" in _refused(inside / "a.mp4", errors.UnsupportedMediaSource, INLINE_ONLY, tiny_release)
    assert "not inline" in _refused("data:video/mp4;base64,AAAA", errors.InvalidMedia, ANY, tiny_release)
    _refused(tmp_path / "missing.mp4", errors.InvalidMedia, ANY, tiny_release)


@pytest.fixture()
def http_server(clips, tmp_path):
    """Serves the clips, and counts every request (a playlist must not make FFmpeg fetch anything)."""
    (tmp_path / "a.mp4").write_bytes(clips["mpeg4 30 fps, 25 frames"].read_bytes())
    seen: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def do_GET(self):
            seen.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen, tmp_path
    server.shutdown()
    server.server_close()


def test_urls_under_the_allow_list(tiny_release, clips, http_server):
    url, seen, root = http_server
    settings = video_settings(load_processor_config(tiny_release), parse_media_kwargs({})[0])
    fetched = load_video(f"{url}/a.mp4", MediaPolicy(url_allow=("127.0.0.1",)), settings, "videos.0")
    local = load_video(str(clips["mpeg4 30 fps, 25 frames"]), ANY, settings, "videos.0")
    assert torch.equal(fetched.frames, local.frames) and fetched.indices == local.indices
    assert "not allowed" in _refused(f"{url}/a.mp4", errors.UnsupportedMediaSource, INLINE_ONLY, tiny_release)
    _refused(f"{url}/a.mp4", errors.MediaTooLarge, MediaPolicy(url_allow=("*",), url_max_bytes=1000), tiny_release)
    # An HLS playlist naming a segment on that server: refused before FFmpeg opens what it lists.
    (root / "list.m3u8").write_text(f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{url}/a.mp4\n#EXT-X-ENDLIST\n")
    seen.clear()
    _refused(root / "list.m3u8", errors.InvalidMedia, ANY, tiny_release)
    assert seen == []


def test_a_request_names_the_video_field(tiny_model_dir, clips, tmp_path):
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 100)
    good = str(clips["mpeg4 30 fps, 25 frames"])
    with Clef.load(tiny_model_dir, state_cache_mb=0) as clef:
        with pytest.raises(errors.InvalidMedia) as caught:
            clef.prepare({"state": "x", "videos": [good, str(tmp_path / "bad.mp4")], "questions": QUESTIONS})
        assert caught.value.field == "videos.1"
        with pytest.raises(errors.UnsupportedMediaSource) as caught:
            clef.prepare({"state": "x", "videos": [good], "questions": QUESTIONS}, media_policy=INLINE_ONLY)
        assert caught.value.field == "videos.0"

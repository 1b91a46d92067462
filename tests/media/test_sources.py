"""Image strings -> RGB pictures under a MediaPolicy: every source kind and every refusal, with its field."""

from __future__ import annotations

import base64
import http.server
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
from media_helpers import data_uri, encode, exif_rotated_jpeg, picture, refusal

from clef_gguf.core import errors
from clef_gguf.media import INLINE_ONLY, MediaPolicy, load_image, load_images, load_video_frames
from clef_gguf.media.sources import url_allowed

PNG = encode(picture(20, 12))
SLOW_BYTES = 300  # of the slow server's trickle, a byte every 0.1 s (30 s in all)
LOCAL = MediaPolicy(local_paths=True)


def _pixels(image: PIL.Image.Image) -> np.ndarray:
    return np.asarray(image)


def test_data_uri_and_raw_base64_always():
    expected = _pixels(picture(20, 12))
    for source in (data_uri(PNG), base64.b64encode(PNG).decode(), base64.encodebytes(PNG).decode()):
        image = load_image(source, INLINE_ONLY, "images.0")
        assert image.mode == "RGB" and image.size == (20, 12)
        assert np.array_equal(_pixels(image), expected)


def test_local_paths_absolute_and_relative(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    (tmp_path / "plain").write_bytes(PNG)
    assert load_image(str(tmp_path / "a.png"), LOCAL, "images.0").size == (20, 12)
    relative = MediaPolicy(base_dir=tmp_path)
    assert load_image("a.png", relative, "images.0").size == (20, 12)
    assert load_image("plain", relative, "images.0").size == (20, 12)
    with pytest.raises(errors.InvalidMedia) as caught:
        load_image("missing.png", relative, "images.4")
    assert caught.value.field == "images.4"


def test_local_paths_refused_without_touching_the_file(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    for source in (str(tmp_path / "a.png"), "a.png", "../etc/passwd"):
        with pytest.raises(errors.UnsupportedMediaSource) as caught:
            load_image(source, MediaPolicy(local_paths=False, base_dir=tmp_path), "images.1")
        assert caught.value.field == "images.1" and caught.value.code == "unsupported_media_source"
        assert caught.value.status == 422


def test_rgba_alpha_dropped_not_blended():
    rgba = picture(16, 16, 3, "RGBA")
    image = load_image(data_uri(encode(rgba)), INLINE_ONLY, "images.0")
    assert np.array_equal(_pixels(image), np.asarray(rgba)[..., :3])


def test_exif_rotation_applied():
    image = load_image(data_uri(exif_rotated_jpeg(40, 24), "image/jpeg"), INLINE_ONLY, "images.0")
    assert image.size == (24, 40)  # orientation 6: stored 40x24, viewed 24x40


def _damaged_png() -> bytes:
    body = bytearray(PNG)
    idat = body.index(b"IDAT")
    body[idat + 8: idat + 40] = bytes(32)
    return bytes(body)


@pytest.mark.parametrize("data, why", [
    (b"not an image at all", "unknown"),
    (PNG[: len(PNG) // 2], "truncated"),
    (encode(picture(20, 12), "JPEG")[:200], "truncated jpeg"),
    (encode(picture(8, 8), "BMP"), "a format the reference does not decode"),
    (encode(picture(8, 8), "TIFF"), "a format the reference does not decode"),
])
def test_bad_bytes_are_invalid_media(data, why):
    with pytest.raises(errors.InvalidMedia) as caught:
        load_image(data_uri(data), INLINE_ONLY, "images.2")
    assert caught.value.field == "images.2" and caught.value.code == "invalid_media", why


def test_corrupt_png_is_invalid_media():
    with pytest.raises(errors.InvalidMedia):
        load_image(data_uri(_damaged_png()), INLINE_ONLY, "images.0")


def test_not_base64_and_bad_data_uris():
    for source in ("data:text/plain;base64,aGVsbG8=", "data:image/png;base64,", "data:image/png,", "QUJD", "QUJ"):
        with pytest.raises(errors.InvalidMedia):
            load_image(source, INLINE_ONLY, "images.0")
    # Characters base64 never has make it a path: refused where paths are, missing where they are allowed.
    with pytest.raises(errors.UnsupportedMediaSource):
        load_image("@@@@", INLINE_ONLY, "images.0")
    with pytest.raises(errors.InvalidMedia, match="no such image file"):
        load_image("@@@@", LOCAL, "images.0")


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares a huge size: Pillow reads the size before any pixel."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def test_decompression_bomb_and_pixel_budget():
    bomb = data_uri(_png_header_only(20_000, 20_000))  # 400 MP: over twice Pillow's limit
    with pytest.raises(errors.MediaTooLarge) as caught:
        load_image(bomb, MediaPolicy(max_pixels=10**12), "images.0")
    assert caught.value.status == 413 and caught.value.code == "media_too_large"
    with pytest.raises(errors.MediaTooLarge) as caught:
        load_image(data_uri(PNG), MediaPolicy(max_pixels=100), "images.3")
    assert caught.value.field == "images.3" and "budget" in caught.value.message


def test_too_many_images_and_empty_video():
    with pytest.raises(errors.MediaTooLarge) as caught:
        load_images([data_uri(PNG)] * 3, MediaPolicy(max_images=2))
    assert caught.value.field == "images"
    with pytest.raises(errors.InvalidMedia) as caught:
        load_video_frames([], INLINE_ONLY, "videos.1")
    assert caught.value.field == "videos.1"
    with pytest.raises(errors.InvalidMedia) as caught:
        load_video_frames([data_uri(PNG), "QUJD"], INLINE_ONLY, "videos.0")
    assert caught.value.field == "videos.0.1"


def test_animated_gif_refused_still_gif_read():
    frames = [picture(8, 8, s).convert("P") for s in range(2)]
    buffer = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(errors.InvalidMedia, match="animated"):
        load_image(data_uri(buffer, "image/gif"), INLINE_ONLY, "images.0")
    assert load_image(data_uri(encode(frames[0], "GIF"), "image/gif"), INLINE_ONLY, "images.0").mode == "RGB"
    # APNG: torchvision's libpng reads the first picture, as Pillow opens it.
    first, second = picture(8, 8, 0), picture(8, 8, 1)
    apng = load_image(data_uri(encode(first, "PNG", save_all=True, append_images=[second])), INLINE_ONLY, "images.0")
    assert np.array_equal(_pixels(apng), _pixels(first))


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    (root / "a.png").write_bytes(PNG)
    (root / "big.png").write_bytes(PNG + bytes(5000))

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            if self.path == "/slow.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                try:
                    for i in range(SLOW_BYTES):
                        self.wfile.write(PNG[i:i + 1])
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:  # the client gave up, as it should
                    pass
                return
            if self.path == "/elsewhere":
                self.send_response(302)
                self.send_header("Location", "http://localhost:1/a.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_url_refused_without_an_allow_list(http_server):
    with pytest.raises(errors.UnsupportedMediaSource) as caught:
        load_image(f"{http_server}/a.png", LOCAL, "videos.0.2")
    assert caught.value.field == "videos.0.2"
    with pytest.raises(errors.UnsupportedMediaSource):
        load_image(f"{http_server}/a.png", MediaPolicy(url_allow=("example.com",)), "images.0")


def test_url_allowed_is_fetched(http_server):
    for allow in (("127.0.0.1",), (http_server + "/",), ("*",)):
        image = load_image(f"{http_server}/a.png", MediaPolicy(url_allow=allow), "images.0")
        assert np.array_equal(_pixels(image), _pixels(picture(20, 12)))


def test_url_failures(http_server):
    policy = MediaPolicy(url_allow=("127.0.0.1",))
    with pytest.raises(errors.InvalidMedia, match="404"):
        load_image(f"{http_server}/missing.png", policy, "images.0")
    with pytest.raises(errors.MediaTooLarge):
        load_image(f"{http_server}/big.png", MediaPolicy(url_allow=("127.0.0.1",), url_max_bytes=1000), "images.0")
    with pytest.raises(errors.UnsupportedMediaSource, match="redirects"):
        load_image(f"{http_server}/elsewhere", policy, "images.0")
    started = time.monotonic()
    with pytest.raises(errors.InvalidMedia, match="took over"):  # a byte every 0.1 s: each read is quick
        load_image(f"{http_server}/slow.png", MediaPolicy(url_allow=("127.0.0.1",), url_timeout_s=0.5), "images.0")
    # the whole trickle takes SLOW_BYTES / 10 s: the deadline cut it short, on a machine under any load
    assert time.monotonic() - started < SLOW_BYTES / 10 / 2


def test_url_allow_list_matching():
    assert url_allowed("https://img.example.com/x.png", (".example.com",))
    assert url_allowed("https://example.com:8443/x.png", ("example.com:8443",))
    assert not url_allowed("https://example.com.evil.net/x.png", ("example.com",))
    assert not url_allowed("https://evil.net/?https://cdn.example.com/img/", ("https://cdn.example.com/img/",))
    assert not url_allowed("file:///etc/passwd", ("*",))


def test_nothing_reads_the_filesystem_for_inline_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("QUJD").write_bytes(PNG)  # a file whose name is also valid base64
    with pytest.raises(errors.InvalidMedia):
        load_image("QUJD", INLINE_ONLY, "images.0")
    assert load_image("QUJD", LOCAL, "images.0").size == (20, 12)


# ------------------------------------------------------------- the server's file allow-list
def _roots(*dirs: Path) -> MediaPolicy:
    return MediaPolicy(local_paths=True, file_roots=tuple(d.resolve() for d in dirs))


def _refused(source: str, policy: MediaPolicy, kind: type = errors.UnsupportedMediaSource) -> str:
    """The refusal's message; it must name the field and come at once (no read of a pipe or device)."""
    return refusal(lambda: load_image(source, policy, "images.2"), kind, "images.2").message


def test_allowed_directories_read_files_inside_them_only(tmp_path):
    inside, outside = tmp_path / "pics", tmp_path / "private"
    inside.mkdir(), outside.mkdir()
    (inside / "a.png").write_bytes(PNG)
    (inside / "deep").mkdir()
    (inside / "deep" / "b.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    policy = _roots(inside)
    assert load_image(str(inside / "a.png"), policy, "images.0").size == (20, 12)
    assert load_image(str(inside / "deep" / "b.png"), policy, "images.0").size == (20, 12)
    assert load_image(str(inside / "deep" / ".." / "a.png"), policy, "images.0").size == (20, 12)
    relative = MediaPolicy(local_paths=True, base_dir=inside, file_roots=(inside.resolve(),))
    assert load_image("deep/b.png", relative, "images.0").size == (20, 12)
    assert "--media-allow-files" in _refused(str(outside / "secret.png"), policy)
    assert "--media-allow-files" in _refused(str(inside / ".." / "private" / "secret.png"), policy)
    assert "--media-allow-files" in _refused("../private/secret.png", relative)
    _refused("/etc/hostname", policy, errors.InvalidMedia)  # base64 alphabet only: never read as a file
    # a second allowed directory opens it
    assert load_image(str(outside / "secret.png"), _roots(inside, outside), "images.0").size == (20, 12)


def test_a_symlink_is_followed_to_where_it_points(tmp_path):
    inside, outside = tmp_path / "pics", tmp_path / "private"
    inside.mkdir(), outside.mkdir()
    (outside / "secret.png").write_bytes(PNG)
    (inside / "a.png").write_bytes(PNG)
    (inside / "link-out.png").symlink_to(outside / "secret.png")
    (inside / "dir-out").symlink_to(outside)
    (inside / "link-in.png").symlink_to(inside / "a.png")
    policy = _roots(inside)
    _refused(str(inside / "link-out.png"), policy)
    _refused(str(inside / "dir-out" / "secret.png"), policy)
    assert load_image(str(inside / "link-in.png"), policy, "images.0").size == (20, 12)


def test_pipes_devices_and_directories_are_refused_at_once(tmp_path):
    import os

    (tmp_path / "fifo").mkdir()
    fifo = tmp_path / "fifo" / "pipe.png"
    os.mkfifo(fifo)  # nobody writes: reading it would wait forever
    (tmp_path / "sub.png").mkdir()
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    policy = _roots(tmp_path)
    assert "regular file" in _refused(str(fifo), policy)
    assert "regular file" in _refused(str(tmp_path / "sub.png"), policy)
    _refused(str(tmp_path / "zero.png"), policy)  # resolves to /dev: outside the allowed directory
    assert "regular file" in _refused(str(tmp_path / "zero.png"), _roots(tmp_path, Path("/dev")))
    _refused("/dev/zero", _roots(Path("/dev")), errors.InvalidMedia)  # base64's alphabet: not a path
    _refused(str(tmp_path / "missing.png"), policy, errors.InvalidMedia)


def test_base64_looking_names_outside_the_directories_are_not_read(tmp_path):
    """A string of base64's alphabet that names a file outside: decoded as base64, never read."""
    inside, outside = tmp_path / "pics", tmp_path / "private"
    inside.mkdir(), outside.mkdir()
    (outside / "secret").write_bytes(PNG)
    (inside / "plain").write_bytes(PNG)
    policy = MediaPolicy(local_paths=True, base_dir=inside, file_roots=(inside.resolve(),))
    assert load_image("plain", policy, "images.0").size == (20, 12)
    looking_out = MediaPolicy(local_paths=True, base_dir=outside, file_roots=(inside.resolve(),))
    _refused("secret", looking_out, errors.InvalidMedia)  # the base64 "secret": not an image
    _refused("../private/secret", policy)  # '.' is no base64: a path, and outside


def test_a_nul_in_a_path_and_an_oversized_file_are_refused_naming_the_field(tmp_path):
    (tmp_path / "big.png").write_bytes(PNG + b"\0" * 4096)
    for policy in (_roots(tmp_path), LOCAL):
        assert "NUL" in _refused(f"{tmp_path}/a\x00b.png", policy, errors.InvalidMedia)
    small = MediaPolicy(local_paths=True, file_roots=(tmp_path.resolve(),), url_max_bytes=len(PNG))
    assert "exceeds" in _refused(str(tmp_path / "big.png"), small, errors.MediaTooLarge)

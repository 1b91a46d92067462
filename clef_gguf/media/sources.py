"""One image string -> one upright RGB Pillow image, as the reference's processor reads it.

The reference hands image strings to transformers' fast image processor, whose ``fetch_images`` decodes
them with torchvision (``load_image_as_tensor``): ``http(s)://`` URLs are fetched, an existing file is
read, anything else is base64 (a ``data:image/...`` prefix dropped), then decoded with the EXIF rotation
applied and alpha dropped (``ImageReadMode.RGB``: libpng strips alpha, it does not blend). Pillow's
``exif_transpose`` + ``convert("RGB")`` gives the same pixels for the formats torchvision decodes,
which are the formats accepted here (``DECODED_IMAGE_TYPES``).

What a request may name is a ``MediaPolicy``: ``data:`` URIs and raw base64 always; local paths and
URLs only when allowed (a server that reads what a request names is an SSRF and file-disclosure hole).
The CLI and the Python API read any file the user names; ``serve`` reads files only under the
directories of ``--media-allow-files`` (``file_roots``): the real path, symlinks followed, must lie
inside one, and it must be a regular file (a FIFO, ``/dev/zero`` or a directory would hang or
never end).
Every refusal is a ``ClefError`` naming the field (``images.1``, ``videos.0.2``).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from http.client import HTTPMessage
from pathlib import Path
from typing import IO

import PIL.Image
import PIL.ImageOps

from clef_gguf.core import errors, refusals
from clef_gguf.core.limits import KiB, MiB

# What torchvision's decode_image reads (AVIF/HEIC need an extra package the reference does not have);
# MPO is how Pillow names the multi-picture JPEGs cameras write (torchvision decodes the first picture).
DECODED_IMAGE_TYPES = ("JPEG", "MPO", "PNG", "GIF", "WEBP")
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_MAX_IMAGES = 32
URL_TIMEOUT_S = 10.0
URL_MAX_BYTES = 32 * MiB
_CHUNK = 64 * KiB
# Video files: ten minutes, the processor's own max_frames, ~0.9 GB of RGB frames held at once, and a
# decode deadline (FFmpeg decodes every frame up to the last one sampled).
DEFAULT_MAX_VIDEO_SECONDS = 600.0
DEFAULT_MAX_VIDEO_FRAMES = 768
DEFAULT_MAX_VIDEO_PIXELS = 300_000_000
VIDEO_DECODE_S = 60.0

_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")


@dataclass(frozen=True)
class MediaPolicy:
    """What a request may name. ``url_allow`` entries: ``"*"`` (any), a host (``"example.com"``,
    ``"example.com:8080"``, ``".example.com"`` for its subdomains too) or a URL prefix
    (``"https://cdn.example.com/img/"``); empty = no fetching. Relative paths resolve against
    ``base_dir`` (the working directory when None). ``max_pixels`` is a budget per decoded picture,
    ``max_images`` the number of pictures (images and video frames together) one request may decode.
    ``file_roots``: when set, a local path is read only if its real path lies inside one of these
    (resolved) directories and is a regular file; None reads any file (what the user named).
    Video files (``video_files``): at most ``max_video_seconds`` long by their container,
    ``max_video_frames`` frames kept per video after sampling, ``max_video_pixels`` decoded pixels
    kept (frames x width x height, all the request's video files together), and ``video_decode_s``
    seconds of decoding per video."""

    local_paths: bool = True
    base_dir: Path | None = None
    file_roots: tuple[Path, ...] | None = None
    url_allow: tuple[str, ...] = ()
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES
    url_timeout_s: float = URL_TIMEOUT_S
    url_max_bytes: int = URL_MAX_BYTES
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS
    video_decode_s: float = VIDEO_DECODE_S


# The server's default: inline images only.
INLINE_ONLY = MediaPolicy(local_paths=False)


def file_roots_help(refused: str) -> str:
    """``--media-allow-files [DIR]``'s help (``serve``'s settings, ``mcp``); ``refused``: what happens to a
    path without the flag."""
    return ("let requests name images and video files by local path (relative to the working "
            "directory), when the file (symlinks followed) lies inside DIR; "
            f"repeatable; without DIR: the working directory. Default: {refused}")


def add_file_roots_argument(group: Any, refused: str) -> None:
    """``--media-allow-files [DIR]`` on an argparse group (``mcp``; ``serve``'s is generated from its
    settings): what ``served_sources`` reads. ``refused``: what happens to a path without the flag."""
    group.add_argument("--media-allow-files", action="append", nargs="?", const=".", metavar="DIR",
                       default=None, help=file_roots_help(refused))


def served_sources(args: Any) -> MediaPolicy:
    """What ``serve``'s ``--media-allow-url`` / ``--media-allow-files DIR`` open beyond inline
    images; a DIR that is not a directory is refused here, before the server starts."""
    dirs = tuple(getattr(args, "media_allow_files", None) or ())
    roots = []
    for given in dirs:
        root = Path(given).resolve()
        if not root.is_dir():
            raise errors.InvalidSetting(f"--media-allow-files {given!r} is not a directory",
                                        field="media_allow_files")
        roots.append(root)
    return replace(INLINE_ONLY, url_allow=tuple(getattr(args, "media_allow_url", None) or ()),
                   local_paths=bool(roots), file_roots=tuple(roots) if roots else None)


def url_allowed(url: str, allow: Sequence[str]) -> bool:
    """Whether ``url`` (http or https) matches an entry of the allow-list."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    host = parts.hostname.lower()
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    for entry in allow:
        entry = entry.strip()
        if entry == "*":
            return True
        if "://" in entry:
            if url.startswith(entry):
                return True
        elif entry.startswith("."):
            if host.endswith(entry.lower()) or host == entry[1:].lower():
                return True
        elif entry.lower() in (host, netloc):
            return True
    return False


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects (as the reference's httpx does) only to allowed URLs."""

    def __init__(self, allow: Sequence[str], field: str, kind: str = "image") -> None:
        super().__init__()
        self.allow, self.field, self.kind = tuple(allow), field, kind

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: HTTPMessage, newurl: str) -> urllib.request.Request | None:
        if not url_allowed(newurl, self.allow):
            raise errors.UnsupportedMediaSource(f"the {self.kind} URL redirects to {newurl!r}, which is not allowed",
                                                field=self.field)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_url(url: str, policy: MediaPolicy, field: str, kind: str = "image") -> bytes:
    """The body of ``url``, at most ``policy.url_max_bytes``; refused unless the allow-list names it."""
    if not url_allowed(url, policy.url_allow):
        raise errors.UnsupportedMediaSource(
            f"fetching {kind} URLs is not allowed here" if not policy.url_allow
            else f"the {kind} URL {url!r} is not on the allow-list", field=field)
    opener = urllib.request.build_opener(_CheckedRedirects(policy.url_allow, field, kind))
    # The timeout bounds each socket wait; the deadline bounds the whole body (a server sending a
    # byte every few seconds must not hold a request forever).
    deadline = time.monotonic() + policy.url_timeout_s
    chunks: list[bytes] = []
    size = 0
    try:
        with opener.open(urllib.request.Request(url), timeout=policy.url_timeout_s) as response:
            while size <= policy.url_max_bytes:
                chunk = response.read1(min(_CHUNK, policy.url_max_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    raise errors.InvalidMedia(f"fetching the {kind} URL took over {policy.url_timeout_s:g} s",
                                              field=field)
    except errors.ClefError:
        raise
    except urllib.error.HTTPError as exc:
        raise errors.InvalidMedia(f"fetching the {kind} URL failed: HTTP {exc.code}", field=field) from None
    except (OSError, ValueError) as exc:
        raise errors.InvalidMedia(f"fetching the {kind} URL failed: {exc}", field=field) from None
    if size > policy.url_max_bytes:
        raise errors.MediaTooLarge(refusals.canvas(f"the {kind} URL's body exceeds {policy.url_max_bytes} bytes",
                                                   f"{policy.url_max_bytes} bytes per {kind}"), field=field)
    return b"".join(chunks)


def _local_file(source: str, policy: MediaPolicy, field: str) -> Path:
    if "\x00" in source:  # no file system takes it (os.stat raises ValueError, not OSError)
        raise errors.InvalidMedia("a file path cannot contain a NUL character", field=field)
    path = Path(source)
    if not path.is_absolute() and policy.base_dir is not None:
        path = policy.base_dir / path
    return path


def _inside(path: str, roots: tuple[Path, ...]) -> bool:
    return any(Path(path).is_relative_to(root) for root in roots)


def read_source(source: str, policy: MediaPolicy, field: str) -> bytes:
    """The encoded bytes an image string names: a URL's body, a file's bytes, or decoded base64."""
    if not isinstance(source, str):
        raise errors.InvalidMedia("an image must be a string (a data: URI, base64, a path or a URL)",
                                  field=field)
    if source.startswith(("http://", "https://")):
        return fetch_url(source, policy, field)
    inline = source.startswith("data:")
    # A string with characters base64 never has ("photo.png", "C:\\x") is a path, whatever the policy.
    if not inline and not _BASE64.fullmatch(source):
        if not policy.local_paths:
            raise errors.UnsupportedMediaSource("reading local image files is not allowed here", field=field)
        path = _local_file(source, policy, field)
        if policy.file_roots is None and not path.is_file():
            raise errors.InvalidMedia("no such image file, and not a data: URI or base64", field=field)
        return _read_file(path, policy, field)
    if not inline and policy.local_paths and len(source) < 4096:
        path = _local_file(source, policy, field)
        if path.is_file() and (policy.file_roots is None
                               or _inside(os.path.realpath(path), policy.file_roots)):
            return _read_file(path, policy, field)
    if source.startswith("data:image/"):
        source = source.split(",")[1] if "," in source else ""
    elif inline:
        raise errors.InvalidMedia("a data: URI must carry an image (data:image/...)", field=field)
    try:
        return base64.decodebytes(source.encode())
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise errors.InvalidMedia("not valid base64", field=field) from None


def _read_file(path: Path, policy: MediaPolicy, field: str) -> bytes:
    if policy.file_roots is None:  # the user's own command: any file they name
        try:
            return path.read_bytes()
        except OSError as exc:
            raise errors.InvalidMedia(f"cannot read the image file: {exc.strerror}", field=field) from None
    return _read_allowed(path, policy.file_roots, field, policy.url_max_bytes)


def _read_allowed(path: Path, roots: tuple[Path, ...], field: str, max_bytes: int) -> bytes:
    with _open_allowed(path, roots, field) as file:
        try:
            data = file.read(max_bytes + 1)  # bounded, as a URL's body and the request's are
        except OSError as exc:
            raise errors.InvalidMedia(f"cannot read the image file: {exc.strerror}", field=field) from None
    if len(data) > max_bytes:
        raise errors.MediaTooLarge(refusals.canvas(f"the image file exceeds {max_bytes} bytes",
                                                   f"{max_bytes} bytes per image"), field=field)
    return data


def _open_allowed(path: Path, roots: tuple[Path, ...], field: str, kind: str = "image") -> IO[bytes]:
    """A file under the allow-list: its real path inside a root, a regular file. Opened without
    blocking (a FIFO would wait for a writer forever), then checked again after the open: the path
    resolves inside a root still and names the very file the descriptor holds (device and inode),
    so a directory swapped for a symlink between the check and the open is still refused (POSIX;
    no /proc needed)."""
    outside = errors.UnsupportedMediaSource(
        f"this server reads {kind} files only inside the directories given to --media-allow-files",
        field=field)
    real = os.path.realpath(path)
    if not _inside(real, roots):
        raise outside
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise errors.InvalidMedia(f"no such {kind} file", field=field) from None
    except OSError as exc:
        raise errors.UnsupportedMediaSource(f"cannot open the {kind} file: {exc.strerror}",
                                            field=field) from None
    try:
        held = os.fstat(fd)
        again = os.path.realpath(path)
        try:
            named = os.stat(again)
        except OSError:
            raise outside from None
        if not _inside(again, roots) or (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
            raise outside
        if not stat.S_ISREG(held.st_mode):
            raise errors.UnsupportedMediaSource("not a regular file (a directory, a device or a "
                                                "pipe is never read)", field=field)
        return open(fd, "rb")  # the file object owns the descriptor from here
    except BaseException:
        os.close(fd)
        raise


def open_source(source: str, policy: MediaPolicy, field: str, kind: str = "video") -> IO[bytes]:
    """A video string opened for decoding, under the same policy as ``read_source``. The reference's
    video loader takes an ``http(s)`` URL (its body, fetched whole) or an existing file, nothing inline;
    a file is streamed, not read into memory (videos are large)."""
    if not isinstance(source, str):
        raise errors.InvalidMedia(f"a {kind} must be a string (a file path or URL) or a list of frames",
                                  field=field)
    if source.startswith(("http://", "https://")):
        return io.BytesIO(fetch_url(source, policy, field, kind))
    if source.startswith("data:") or not source:
        raise errors.InvalidMedia(f"a {kind} file is read from a path or an http(s) URL (as the reference's "
                                  "loader reads it), not inline; or send its frames as a list", field=field)
    if not policy.local_paths:
        raise errors.UnsupportedMediaSource(f"reading local {kind} files is not allowed here", field=field)
    path = _local_file(source, policy, field)
    if policy.file_roots is not None:
        return _open_allowed(path, policy.file_roots, field, kind)
    if not path.is_file():  # the user's own command: any regular file they name
        raise errors.InvalidMedia(f"no such {kind} file", field=field)
    try:
        return path.open("rb")
    except OSError as exc:
        raise errors.InvalidMedia(f"cannot read the {kind} file: {exc.strerror}", field=field) from None


def _bomb(exc: Exception, policy: MediaPolicy, field: str) -> errors.MediaTooLarge:
    return errors.MediaTooLarge(refusals.canvas(f"the image is a decompression bomb: {str(exc).rstrip('.')}",
                                                f"{policy.max_pixels} pixels"), field=field)


def decode_image(data: bytes, policy: MediaPolicy, field: str) -> PIL.Image.Image:
    """Encoded bytes -> a fully loaded, EXIF-rotated RGB image (alpha dropped, not blended)."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
    except PIL.Image.DecompressionBombError as exc:
        raise _bomb(exc, policy, field) from None
    except (OSError, SyntaxError, ValueError, EOFError):
        raise errors.InvalidMedia("not an image in a format we decode (PNG, JPEG, GIF, WebP)",
                                  field=field) from None
    with image:
        if image.format not in DECODED_IMAGE_TYPES:
            raise errors.InvalidMedia(f"unsupported image format {image.format} (PNG, JPEG, GIF, WebP)",
                                      field=field)
        width, height = image.size
        if width * height > policy.max_pixels:
            raise errors.MediaTooLarge(refusals.canvas(f"the image has {width}x{height} pixels, over the budget "
                                                       f"of {policy.max_pixels}", f"{policy.max_pixels} pixels"),
                                       field=field)
        # torchvision decodes every GIF frame (a 4-D tensor the processor cannot take) and refuses
        # animated WebP; for APNG and MPO it reads the first picture, as Pillow opens them.
        if image.format in ("GIF", "WEBP") and getattr(image, "n_frames", 1) > 1:
            raise errors.InvalidMedia("animated images are not decoded; send the frames as a video",
                                      field=field)
        try:
            image.load()
            upright = PIL.ImageOps.exif_transpose(image)
            rgb = upright.convert("RGB")
            rgb.load()
        except PIL.Image.DecompressionBombError as exc:
            raise _bomb(exc, policy, field) from None
        except (OSError, SyntaxError, ValueError, EOFError, IndexError):
            raise errors.InvalidMedia("the image data is corrupt or truncated", field=field) from None
    if rgb.width < 1 or rgb.height < 1:
        raise errors.InvalidMedia("the image is empty", field=field)
    return rgb


def load_image(source: str, policy: MediaPolicy, field: str) -> PIL.Image.Image:
    """One image string -> an RGB image, or a ClefError naming ``field``."""
    return decode_image(read_source(source, policy, field), policy, field)


def check_count(count: int, policy: MediaPolicy, field: str) -> None:
    """Refuse a request that would decode more than ``policy.max_images`` pictures."""
    if count > policy.max_images:
        raise errors.MediaTooLarge(refusals.canvas(f"{count} images or video frames, over the limit of "
                                                   f"{policy.max_images}",
                                                   f"{policy.max_images} images or video frames"), field=field)


def load_images(sources: Sequence[str], policy: MediaPolicy, field: str = "images") -> list[PIL.Image.Image]:
    """A request's ``images`` list -> RGB images (fields ``images.0``, ``images.1``, ...)."""
    check_count(len(sources), policy, field)
    return [load_image(source, policy, f"{field}.{i}") for i, source in enumerate(sources)]


def load_video_frames(frames: Sequence[str], policy: MediaPolicy, field: str) -> list[PIL.Image.Image]:
    """One video's frame strings -> RGB frames (fields ``<field>.0``, ...); no frames is invalid."""
    if not isinstance(frames, Sequence) or isinstance(frames, str) or not frames:
        raise errors.InvalidMedia("a video must be a non-empty list of frames", field=field)
    check_count(len(frames), policy, field)
    return [load_image(frame, policy, f"{field}.{j}") for j, frame in enumerate(frames)]

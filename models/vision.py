"""The vision part of a catalog model, taken from its release: only the vision tensors of its shards.

The head source (Cloudflare's release) keeps the vision tower inside its safetensors shards, which are
GBs (the 9B's vision tensors are ~0.9 GB of them). A pull reads each shard's header with HTTP Range
requests (8 bytes of header length, then the JSON header), fetches only the ``model.visual.*`` byte
ranges (adjacent ones merged into one request) and writes
``$HF_HOME/clef-gguf/vision/<repo>@<commit>/`` laid out like a converted model's vision part:
``vision.safetensors`` (prefix stripped, dtypes and shapes as stored), ``vision_config.json``
(config.json's ``vision_config``, verbatim), the release's processor files, and ``clef-gguf-vision.json``
listing each file's sha256 and size. Everything is read at one commit, so the headers are pinned by it;
each range's length is checked against its header. A release without a vision tower gets the list
alone (``"vision": false``), so a later pull asks nothing either. Later resolves check the files
against the list (hashes stamped like the cache's blobs) and never touch the network.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from filelock import FileLock, Timeout

from clef_gguf.core.errors import CorruptModel, ModelLoadError, ModelNotFound
from clef_gguf.core.limits import MiB
from clef_gguf.formats.files import (CHECKPOINT_CONFIG, SAFETENSORS_INDEX, VISION_CONFIG, VISION_PREFIXES,
                                     VISION_WEIGHTS, staged_directory)
from clef_gguf.models.catalog import Source
from clef_gguf.models.download import download, hub_errors, hub_file
from clef_gguf.models.hfcache import COMMIT_RE, endpoint, record_verified, token, verify, vision_dir

LIST = "clef-gguf-vision.json"
VISION_LIST_FORMAT = "clef-gguf-vision/1"
SHARDS = "model*.safetensors"
# The release's image and video processor settings, whatever the release calls them (the Hub's split
# preprocessor_config.json / video_preprocessor_config.json, or transformers' nested processor_config.json).
PROCESSOR_FILES = "*processor_config.json"
# safetensors dtype -> bytes per element: the ones a vision tower is stored in (clef_gguf.vision loads these).
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}
HEADER_LIMIT = 100 * MiB  # far above any real header (the 9B's shards: well under 1 MB)
CHUNK = MiB  # bytes per read of a download
LOCK_TIMEOUT_S = 3600  # a second process pulling the same release waits for the first one's ~1 GB


@dataclass(frozen=True)
class Tensor:
    """One vision tensor of a shard: its stored name, dtype, shape and absolute byte range."""

    shard: str
    stored: str
    name: str  # prefix stripped
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def vision_part(src: Source, commit: str | None, *, local_only: bool, progress: bool) -> Path | None:
    """The directory of the vision part of ``src`` at ``commit``, fetched unless ``local_only``; None
    for a release without a vision tower, or (``local_only``) one whose vision part was not pulled."""
    if not commit or not COMMIT_RE.match(commit):
        return None
    out = vision_dir(src.repo, commit)
    done = _checked(out)
    if done is not None or local_only:
        return out if done else None
    lock = out.parent / f".{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock), timeout=LOCK_TIMEOUT_S):
            done = _checked(out)  # another process may have written it while this one waited
            if done is None:
                shutil.rmtree(out, ignore_errors=True)  # incomplete: written again from scratch
                done = _fetch(src, commit, out, progress)
    except Timeout:
        raise ModelLoadError(f"{lock} stayed locked for {LOCK_TIMEOUT_S} s (another pull of "
                             f"{src.repo}?); try again", field="model") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot write the vision part of {src.repo} into {out}: {exc}",
                             field="model") from None
    return out if done else None


def _checked(out: Path) -> bool | None:
    """True: a complete vision part, files verified; False: the release has none; None: not written
    (or incomplete). A file whose hash no longer matches raises ``CorruptModel`` (and is removed)."""
    try:
        listed = json.loads((out / LIST).read_bytes())
    except (OSError, ValueError):
        return None
    files = listed.get("files") if isinstance(listed, dict) and listed.get("format") == VISION_LIST_FORMAT else None
    if not isinstance(files, dict):
        return None
    if not listed.get("vision"):
        return False
    if not all(isinstance(e, dict) and (out / name).is_file() and (out / name).stat().st_size == e.get("size")
               for name, e in files.items()):
        return None
    for name, entry in files.items():
        verify(out / name, entry.get("sha256"), f"the vision part {out / name}")
    return True


def _fetch(src: Source, commit: str, out: Path, progress: bool) -> bool:
    """Write the vision part of ``src`` at ``commit`` into ``out``; False for a text-only release."""
    raw = _vision_config(src, commit, progress)
    if raw is None:
        _write_list(out, src, commit, vision=False, files={})
        return False
    listing = _listing(src, commit)
    tensors = [t for shard in _shards(src, commit, listing, progress)
               for t in _header(src, commit, shard, listing[shard])]
    if not tensors:  # a config left over from the multimodal base; the checkpoint is text-only
        _write_list(out, src, commit, vision=False, files={})
        return False
    names = [t.name for t in tensors]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CorruptModel(f"{src.repo}@{commit}: vision tensors stored twice: {', '.join(twice[:5])}",
                           field="model")
    hashes: dict[str, tuple[str, int]] = {}
    with staged_directory(out) as stage:
        hashes[VISION_WEIGHTS] = _write_weights(src, commit, tensors, stage / VISION_WEIGHTS, progress)
        config = (json.dumps(raw, indent=2) + "\n").encode("utf-8")
        (stage / VISION_CONFIG).write_bytes(config)
        hashes[VISION_CONFIG] = hashlib.sha256(config).hexdigest(), len(config)
        for name in sorted(n for n in listing if fnmatch.fnmatch(n, PROCESSOR_FILES)):
            data = download(src, name, commit, local_only=False, progress=progress).read_bytes()
            (stage / name).write_bytes(data)
            hashes[name] = hashlib.sha256(data).hexdigest(), len(data)
        _write_list(stage, src, commit, vision=True,
                    files={name: {"sha256": sha, "size": size} for name, (sha, size) in hashes.items()},
                    source={t.shard for t in tensors})
    for name, (sha, _) in hashes.items():
        record_verified(out / name, sha)
    return True


def _write_list(out: Path, src: Source, commit: str, *, vision: bool, files: dict[str, Any],
                source: set[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    listed = {"format": VISION_LIST_FORMAT, "repo": src.repo, "commit": commit, "vision": vision,
              "shards": sorted(source or ()), "files": files}
    (out / LIST).write_text(json.dumps(listed, indent=1, sort_keys=True) + "\n")


def _vision_config(src: Source, commit: str, progress: bool) -> dict[str, Any] | None:
    """config.json's ``vision_config``; None when the release has no config.json or no vision_config."""
    from huggingface_hub.errors import EntryNotFoundError

    with hub_errors(src, commit, CHECKPOINT_CONFIG):
        try:
            hub_file(src, CHECKPOINT_CONFIG, commit)
        except EntryNotFoundError:
            return None
    path = download(src, CHECKPOINT_CONFIG, commit, local_only=False, progress=progress)
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CorruptModel(f"{src.repo}@{commit} / {CHECKPOINT_CONFIG} is not JSON: {exc}", field="model") from None
    vision = config.get("vision_config") if isinstance(config, dict) else None
    if vision is not None and not isinstance(vision, dict):
        raise CorruptModel(f"{src.repo}@{commit} / {CHECKPOINT_CONFIG}: vision_config is not an object",
                           field="model")
    return vision


def _listing(src: Source, commit: str) -> dict[str, int]:
    """Top-level file name -> size of ``src`` at ``commit``: one request."""
    from huggingface_hub import HfApi

    listed: dict[str, int] = {}
    with hub_errors(src, commit, "(file list)"):
        for item in HfApi(endpoint=endpoint(), token=token()).list_repo_tree(src.repo, revision=commit):
            size = getattr(item, "size", None)
            if isinstance(size, int) and "/" not in item.path:
                listed[item.path] = size
    return listed


def _shards(src: Source, commit: str, listing: dict[str, int], progress: bool) -> list[str]:
    """The weight files holding vision tensors: those the index names for them, else every shard."""
    if SAFETENSORS_INDEX not in listing:
        return sorted(n for n in listing if fnmatch.fnmatch(n, SHARDS))
    path = download(src, SAFETENSORS_INDEX, commit, local_only=False, progress=progress)
    try:
        weight_map = json.loads(path.read_bytes().decode("utf-8")).get("weight_map")
    except (OSError, ValueError, RecursionError, AttributeError) as exc:
        raise CorruptModel(f"{src.repo}@{commit} / {SAFETENSORS_INDEX} is not an index: {exc}", field="model") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptModel(f"{src.repo}@{commit} / {SAFETENSORS_INDEX} has no weight_map of tensor -> file",
                           field="model")
    shards = sorted({f for name, f in weight_map.items() if name.startswith(VISION_PREFIXES)})
    missing = [f for f in shards if f not in listing]
    if missing:
        raise CorruptModel(f"{src.repo}@{commit} / {SAFETENSORS_INDEX} names weight files the repository does not hold "
                           f"at its top level: {', '.join(missing[:3])}", field="model")
    return shards


def _ranged(src: Source, commit: str, filename: str, begin: int, end: int) -> Iterator[bytes]:
    """The bytes ``begin..end-1`` of a file at ``commit``: one Range request, streamed."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    url = hf_hub_url(src.repo, filename, revision=commit, endpoint=endpoint())
    # identity: a CDN that compresses would ignore the range (and send the whole shard)
    headers = {**build_hf_headers(token=token()), "Range": f"bytes={begin}-{end - 1}",
               "Accept-Encoding": "identity"}
    got = 0
    with hub_errors(src, commit, filename):
        with http_stream_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as resp:
            hf_raise_for_status(resp)
            if resp.status_code != 206:
                raise ModelNotFound(f"{url} answered a byte-range request with HTTP {resp.status_code}, "
                                    "not 206: the vision part needs a server that honours ranges",
                                    field="model")
            for block in resp.iter_bytes(CHUNK):
                block = block[:end - begin - got]
                got += len(block)
                yield block
                if got == end - begin:
                    break
    if got != end - begin:
        raise ModelNotFound(f"{src.repo}@{commit} / {filename}: bytes {begin}-{end - 1} came back short "
                            f"({got} of {end - begin}); run the pull again", field="model")


def _header(src: Source, commit: str, shard: str, size: int) -> list[Tensor]:
    """The vision tensors of one shard, from its safetensors header (two Range requests), checked
    against the shard's size and their own dtypes and shapes."""
    where = f"{src.repo}@{commit} / {shard}"

    def bad(why: str) -> CorruptModel:
        return CorruptModel(f"{where}: {why}", field="model")

    if size < 8:
        raise bad(f"{size} bytes is not a safetensors file")
    (length,) = struct.unpack("<Q", b"".join(_ranged(src, commit, shard, 0, 8)))
    if not 2 <= length <= min(HEADER_LIMIT, size - 8):
        raise bad(f"a safetensors header of {length} bytes does not fit the file ({size} bytes)")
    try:
        header = json.loads(b"".join(_ranged(src, commit, shard, 8, 8 + length)).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise bad(f"the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("the safetensors header is not an object")
    base, data = 8 + length, size - 8 - length
    found: list[Tensor] = []
    for stored, info in header.items():
        prefix = next((p for p in VISION_PREFIXES if stored.startswith(p)), None)
        if prefix is None:
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if dtype not in DTYPE_BYTES:
            raise bad(f"vision tensor {stored} has dtype {dtype!r}, expected one of {', '.join(DTYPE_BYTES)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1] <= data):
            raise bad(f"vision tensor {stored} has a bad shape or data_offsets ({shape!r}, {offsets!r})")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise bad(f"vision tensor {stored}: {offsets[1] - offsets[0]} bytes for a {dtype} {shape}")
        found.append(Tensor(shard, stored, stored[len(prefix):], dtype, tuple(shape),
                            base + offsets[0], base + offsets[1]))
    return sorted(found, key=lambda t: t.begin)


def _runs(tensors: list[Tensor]) -> list[tuple[str, int, int]]:
    """(shard, begin, end) byte ranges to request: each tensor's, adjacent ones merged."""
    runs: list[tuple[str, int, int]] = []
    for t in tensors:
        if runs and runs[-1][0] == t.shard and runs[-1][2] == t.begin:
            runs[-1] = (t.shard, runs[-1][1], t.end)
        else:
            runs.append((t.shard, t.begin, t.end))
    return runs


def _write_weights(src: Source, commit: str, tensors: list[Tensor], path: Path,
                   progress: bool) -> tuple[str, int]:
    """Write ``tensors`` as one safetensors file, their bytes streamed from the shards in order;
    returns (sha256, size) of what was written."""
    from huggingface_hub.utils import tqdm

    offsets: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in tensors:  # the data region in the order the bytes arrive
        offsets[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.end - t.begin]}
        at += t.end - t.begin
    header = json.dumps(offsets, separators=(",", ":")).encode("utf-8")
    header += b" " * (-len(header) % 8)  # the data region starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    total = 0
    with open(path, "wb") as fh, tqdm(total=at, unit="B", unit_scale=True, disable=not progress,
                                      desc="vision tensors") as bar:
        total += _put(fh, digest, struct.pack("<Q", len(header)) + header)
        for shard, begin, end in _runs(tensors):
            for block in _ranged(src, commit, shard, begin, end):
                total += _put(fh, digest, block)
                bar.update(len(block))
    return digest.hexdigest(), total


def _put(fh: IO[bytes], digest: Any, data: bytes) -> int:
    fh.write(data)
    digest.update(data)
    return len(data)


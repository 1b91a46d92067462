"""``clef-gguf batch`` with images on the tiny model: JSONL records name pictures as a request does
(a relative path is relative to the input file), a Parquet binary column holds the image bytes, and a
picture that cannot be read fails its record only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulk_helpers import SCHEMA, lines, run_batch, write_schema
from clef_gguf.bulk.records import image_uri
from clef_gguf.cli import main
from clef_gguf.runtime.model import Clef

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_helpers import data_uri, encode, exif_rotated_jpeg, picture, png_uri  # noqa: E402

MODEL_FLAGS = ("--threads", "1", "--max-length", "2048")


@pytest.fixture(scope="module")
def clef(tiny_model_dir):
    with Clef.load(tiny_model_dir, threads=1, max_length=2048) as loaded:
        yield loaded


def decided(clef: Clef, record_id: str, request: dict) -> dict:
    """The batch output line of a request: its id, then the response less what its usage says of the
    caches (``cached_tokens``, and ``cached_media_tokens`` with pictures)."""
    response = clef.decide(request)
    response["usage"].pop("cached_tokens", None)
    response["usage"].pop("cached_media_tokens", None)
    return {"id": record_id, **response}


def batch(model: Path, *args: object) -> int:
    return main(["batch", "--model", str(model), *MODEL_FLAGS, *map(str, args)])


def _png(seed: int, width: int = 32, height: int = 24) -> bytes:
    return encode(picture(width, height, seed))


def _media_jsonl(folder: Path) -> tuple[Path, list[dict], list[dict]]:
    """An input in ``folder/data`` whose pictures sit beside it; (input, records, the same records
    with every path made absolute, as a caller anywhere would send them)."""
    data = folder / "data"
    (data / "pictures").mkdir(parents=True)
    (data / "pictures" / "a.png").write_bytes(_png(1))
    (data / "b.jpg").write_bytes(exif_rotated_jpeg(40, 24))
    (data / "broken.png").write_bytes(_png(2)[:60])  # a PNG cut short
    records = [
        {"id": "path", "state": "A relative path.", "images": ["pictures/a.png"]},
        {"id": "two", "state": "Two pictures.", "images": ["b.jpg", png_uri(16, 48, 3)]},
        {"id": "text", "state": "No picture at all."},
        {"id": "truncated", "state": "A broken file.", "images": ["broken.png"]},
        {"id": "missing", "state": "Nothing there.", "images": ["pictures/nope.png"]},
        {"id": "garbage", "state": "Not base64.", "images": ["data:image/png;base64,%%%"]},
        {"id": "inline", "state": "An inline one.", "images": [data_uri(_png(4))]},
    ]
    src = data / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    absolute = [dict(r, images=[i if i.startswith("data:") or not (data / i).is_file() else str(data / i)
                                for i in r["images"]])
                if "images" in r else r for r in records]
    return src, records, absolute


def test_jsonl_images_relative_to_the_input_and_bad_ones_fail_their_record(tiny_model_dir, clef, tmp_path,
                                                                           capsys):
    src, _, absolute = _media_jsonl(tmp_path)
    out = tmp_path / "out.jsonl"
    assert batch(tiny_model_dir, "-i", src, "-o", out, "-q", write_schema(tmp_path / "q.json"),
                 "--window", "3") == 0
    got = {r["id"]: r for r in lines(out)}
    assert list(got) == [r["id"] for r in absolute]
    for record in absolute:
        if record["id"] in ("truncated", "missing", "garbage"):
            continue
        request = {k: v for k, v in record.items() if k != "id"} | {"questions": SCHEMA}
        assert got[record["id"]] == decided(clef, record["id"], request)
    assert got["path"]["usage"]["input_tokens"] > got["text"]["usage"]["input_tokens"]
    for record_id in ("truncated", "missing", "garbage"):
        error = got[record_id]["error"]
        assert (error["code"], error["field"]) == ("invalid_media", "images.0"), error
    assert "no such image file" in got["missing"]["error"]["message"]
    assert "4 answered, 3 failed (invalid_media: 3)" in capsys.readouterr().err


def test_parquet_binary_images_column(tiny_model_dir, clef, tmp_path):
    pictures = [[_png(5)], [_png(6, 48, 16), encode(picture(24, 24, 7), "JPEG", quality=90)], [], None,
                [b"\x89PNG\r\n\x1a\n not really"], [_png(8)]]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(pictures))],
                             "state": [f"Picture set {i}." for i in range(len(pictures))],
                             "images": pa.array(pictures, type=pa.list_(pa.binary()))}), src)
    out = tmp_path / "out.jsonl"
    assert batch(tiny_model_dir, "-i", src, "-o", out, "-q", write_schema(tmp_path / "q.json")) == 0
    got = lines(out)
    assert [r["id"] for r in got] == [f"r{i}" for i in range(len(pictures))]
    for i, images in enumerate(pictures):
        if i == 4:
            assert (got[i]["error"]["code"], got[i]["error"]["field"]) == ("invalid_media", "images.0")
            continue
        request = {"state": f"Picture set {i}.", "questions": SCHEMA}
        if images:
            request["images"] = [data_uri(b, "image/jpeg" if b[:3] == b"\xff\xd8\xff" else "image/png")
                                 for b in images]
        assert got[i] == decided(clef, f"r{i}", request)


def test_parquet_single_image_column_of_bytes_and_strings(tiny_model_dir, clef, tmp_path):
    (tmp_path / "c.png").write_bytes(_png(9))
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"state": ["one", "none"],
                             "image": pa.array([_png(10), None], type=pa.binary())}), src)
    out = tmp_path / "out.jsonl"
    assert batch(tiny_model_dir, "-i", src, "-o", out, "-q", write_schema(tmp_path / "q.json")) == 0
    got = lines(out)
    assert got[0] == decided(clef, "0", {"state": "one", "images": [data_uri(_png(10))], "questions": SCHEMA})
    assert got[1] == decided(clef, "1", {"state": "none", "questions": SCHEMA})
    # a string column: paths relative to the input file, as in JSONL
    strings = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"state": ["by path"], "image": ["c.png"]}), strings)
    assert batch(tiny_model_dir, "-i", strings, "-o", tmp_path / "s.jsonl", "-q", tmp_path / "q.json") == 0
    assert lines(tmp_path / "s.jsonl") == [decided(clef, "0", {"state": "by path", "questions": SCHEMA,
                                                               "images": [str(tmp_path / "c.png")]})]


def test_image_uri_names_the_format():
    assert image_uri(_png(1)).startswith("data:image/png;base64,")
    assert image_uri(encode(picture(8, 8), "JPEG")).startswith("data:image/jpeg;base64,")
    assert image_uri(encode(picture(8, 8), "GIF")).startswith("data:image/gif;base64,")
    assert image_uri(encode(picture(8, 8), "WEBP")).startswith("data:image/webp;base64,")
    assert image_uri(b"??").startswith("data:image/unknown;base64,")


def test_parquet_with_both_image_columns_is_refused_before_the_load(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"state": ["s"], "image": [b"x"], "images": [[b"x"]]}), src)
    assert main(["batch", "--model", str(tmp_path / "no-such-model"), "-i", str(src), "-o",
                 str(tmp_path / "o.jsonl"), "-q", str(write_schema(tmp_path / "q.json"))]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["field"] == "images"


def test_help_gives_the_image_rules(capsys):
    with pytest.raises(SystemExit):
        main(["batch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for rule in ("'images' (list of binary or string)", "relative to the input file's directory",
                 "binary value is the image file's bytes", "fails its record only"):
        assert rule in text


@pytest.mark.slow  # starts a private Ray
def test_ray_engine_reads_the_same_pictures(tiny_model_dir, tmp_path):
    src, _, _ = _media_jsonl(tmp_path)
    schema = write_schema(tmp_path / "q.json")
    common = ("-i", str(src), "-q", str(schema), "--window", "3")
    local = run_batch(tiny_model_dir, *common, "-o", str(tmp_path / "local.jsonl"))
    assert local.returncode == 0, local.stderr
    ray = run_batch(tiny_model_dir, *common, "-o", str(tmp_path / "ray.jsonl"), "--engine", "ray",
                    "--replicas", "1", "--threads-per-replica", "1", timeout=300)
    assert ray.returncode == 0, ray.stderr
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    assert "4 answered, 3 failed (invalid_media: 3)" in ray.stderr

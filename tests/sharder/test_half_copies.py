"""``feeder shard --half-copies``: each image also stored at DCT scale 1/2, read by the
daemon for crop windows at least twice the output, checked by ``feeder verify``."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from core.errors import DataError
from decode.augment import Crops, sample_crops
from decode.jobs import Job
from decode.pipeline import PipelineSpec
from decode.runner import PipelineRunner
from protocol.request import AugmentKind, CropRange
from sharder import ShardConfig, shard
from sharder.normalise import HALF_COPY_QUALITY
from sharder.verify import verify
from shards.index import read_index
from shards.layout import HALF_COLUMNS, index_path
from shards.members import read_lmdb_sample
from shards.reader import ShardDataset, half_boxes
from shards.writers import file_sha256
from tests.common.shards import build_sample_shards, seal_index
from tests.sharder.odd_files import encode, odd_inputs, write_tree


def _odd_sized(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return encode(Image.fromarray(cv2.GaussianBlur(pixels, (9, 9), 3)), "JPEG", quality=90)


def _rows(out: Path, split: str = "train") -> list[dict]:
    return pq.read_table(index_path(out, split)).to_pylist()


def _reduced(data: bytes) -> np.ndarray:
    flags = cv2.IMREAD_REDUCED_COLOR_2 | cv2.IMREAD_IGNORE_ORIENTATION
    return cv2.imdecode(np.frombuffer(data, np.uint8), flags)


@pytest.fixture(scope="module")
def halves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    odd = {name: data for name, (data, outcome) in odd_inputs().items() if outcome != "reject"}
    sized = {f"odd{w}x{h}.jpg": _odd_sized(w, w, h) for w, h in ((41, 29), (17, 64), (128, 97))}
    root = tmp_path_factory.mktemp("halves")
    src = write_tree(root / "src", {"odd": odd, "sized": sized})
    out = root / "out"
    shard(ShardConfig(src, out, formats=("wds", "lmdb"), half_copies=True, workers=2))
    return out


def test_every_image_has_a_copy_at_scale_half_with_restart_markers(halves: Path) -> None:
    manifest = json.loads((halves / "manifest.json").read_text())
    assert manifest["options"]["half_copies"] is True
    rows = _rows(halves)
    assert rows and manifest["splits"]["train"]["rejected"] == 0
    for row in rows:
        with tarfile.open(halves / row["shard"]) as tar:
            member = tar.getmember(f"{row['key']}.half.jpg")
            image = tar.extractfile(f"{row['key']}.jpg").read()
            copy = tar.extractfile(member).read()
        assert (member.offset_data, member.size) == (row["half_offset"], row["half_size"])
        pixels = cv2.imdecode(np.frombuffer(copy, np.uint8), cv2.IMREAD_COLOR)
        assert pixels.shape[:2] == ((row["height"] + 1) // 2, (row["width"] + 1) // 2), row["source"]
        # A reduced decode of the image, encoded at HALF_COPY_QUALITY: the restart
        # markers were added losslessly.
        _, expected = cv2.imencode(".jpg", _reduced(image), [cv2.IMWRITE_JPEG_QUALITY, HALF_COPY_QUALITY])
        assert (pixels == cv2.imdecode(expected, cv2.IMREAD_COLOR)).all(), row["source"]
        assert _restart_interval(copy) >= 1 and -(-pixels.shape[1] // 16) % _restart_interval(copy) == 0, \
            "restart intervals that tile the MCU rows (16 px wide at 4:2:0)"
    assert not verify(halves, full=True).problems


def _restart_interval(jpeg_bytes: bytes) -> int:
    at = jpeg_bytes.index(b"\xff\xdd", 0, jpeg_bytes.index(b"\xff\xda"))  # DRI before the scan
    return int.from_bytes(jpeg_bytes[at + 4 : at + 6], "big")


def test_lmdb_keeps_the_images_only(halves: Path) -> None:
    import lmdb

    with lmdb.open(str(halves / "train" / "lmdb"), readonly=True, lock=False) as env:
        for row in _rows(halves):
            with tarfile.open(halves / row["shard"]) as tar:
                image = tar.extractfile(f"{row['key']}.jpg").read()
            assert read_lmdb_sample(env, row["key"])[0] == image


def test_without_the_option_there_are_no_copies(tmp_path: Path) -> None:
    out = build_sample_shards(tmp_path, classes=2, train_per_class=3, val_per_class=1)
    assert all(r["half_size"] == 0 and r["half_offset"] == -1 for r in _rows(out))
    split = ShardDataset.open("s", out).splits["train"]
    assert not split.half_copies.any()
    with tarfile.open(split.shard_paths[0]) as tar:
        assert not [m for m in tar.getnames() if m.endswith(".half.jpg")]


def test_an_index_written_before_the_copies_reads_as_having_none(tmp_path: Path) -> None:
    out = build_sample_shards(tmp_path, classes=2, train_per_class=3, val_per_class=1, half_copies=True)
    path = index_path(out, "train")
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(list(HALF_COLUMNS)).replace_schema_metadata(None), path)  # nor a version
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["splits"]["train"]["index_version"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    seal_index(out, "train")
    assert read_index(out, "train").column("half_size").to_pylist() == [0] * table.num_rows
    split = ShardDataset.open("s", out).splits["train"]
    assert not split.half_copies.any()
    jpegs, boxes, _ = split.read_windows([0], np.array([[0, 0, 64, 64]]), 16)
    assert jpegs[0].tobytes() == split.read(0).tobytes() and boxes.tolist() == [[0, 0, 64, 64]]


def test_an_index_locating_a_copy_before_the_tar_is_refused_at_open(tmp_path: Path) -> None:
    out = build_sample_shards(tmp_path, classes=2, train_per_class=3, val_per_class=1, half_copies=True)
    path = index_path(out, "train")
    table = pq.read_table(path)
    offsets = pa.array([-1] + table.column("half_offset").to_pylist()[1:], pa.int64())
    pq.write_table(table.set_column(table.schema.get_field_index("half_offset"), "half_offset", offsets), path)
    seal_index(out, "train")
    with pytest.raises(DataError, match=r"index.parquet: key .* has half_offset -1, half_size \d+ \(1 rows\)"):
        ShardDataset.open("s", out)


def test_verify_names_a_copy_the_index_does_not_locate_and_a_damaged_copy(tmp_path: Path) -> None:
    out = build_sample_shards(tmp_path, classes=2, train_per_class=3, val_per_class=1, half_copies=True)
    path = index_path(out, "train")
    table = pq.read_table(path)
    moved = pa.array([o + 512 for o in table.column("half_offset").to_pylist()[:1]]
                     + table.column("half_offset").to_pylist()[1:], pa.int64())
    pq.write_table(table.set_column(table.schema.get_field_index("half_offset"), "half_offset", moved), path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["splits"]["train"]["index_sha256"] = file_sha256(path)  # written wrong, not damaged later
    (out / "manifest.json").write_text(json.dumps(manifest))
    key = table.column("key")[0].as_py()
    assert any(f"does not locate {key}.half.jpg" in p for p in verify(out).problems)

    pq.write_table(table, path)  # the right index again; now the copy's bytes are damaged
    manifest["splits"]["train"]["index_sha256"] = file_sha256(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    row = table.slice(1, 1).to_pylist()[0]
    with open(out / row["shard"], "r+b") as f:
        f.seek(row["half_offset"] + row["half_size"] // 2)
        f.write(b"\x00\xff\x13" * 40)
    problems = verify(out, full=True).problems
    assert any(row["key"] in p and "half-scale copy" in p for p in problems), problems


@pytest.mark.parametrize("seed", range(5))
def test_half_boxes_halve_the_edges_inside_the_copy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    widths, heights = rng.integers(1, 900, 500), rng.integers(1, 900, 500)
    x, y = (rng.integers(0, s) for s in (widths, heights))
    w, h = rng.integers(1, widths - x + 1), rng.integers(1, heights - y + 1)
    mapped = half_boxes(np.stack([x, y, w, h], axis=1), widths, heights).astype(np.int64)
    mx, my, mw, mh = mapped.T
    assert (mx >= 0).all() and (my >= 0).all() and (mw >= 1).all() and (mh >= 1).all()
    assert (mx + mw <= (widths + 1) // 2).all() and (my + mh <= (heights + 1) // 2).all()
    assert (np.abs(2 * mx - x) <= 1).all() and (np.abs(2 * (mx + mw) - (x + w)) <= 1).all()
    assert (np.abs(2 * (my + mh) - (y + h)) <= 1).all() and (mw >= w // 2).all() and (mh >= h // 2).all()


def test_windows_twice_the_output_come_from_the_copy(tmp_path: Path) -> None:
    out = build_sample_shards(tmp_path, classes=2, train_per_class=3, val_per_class=1, half_copies=True)
    split = ShardDataset.open("s", out).splits["train"]
    w, h = int(split.widths[0]), int(split.heights[0])
    side = min(w, h)
    boxes = np.array([[0, 0, side, side], [1, 1, side - 1, side - 1], [0, 0, side // 2, side // 2]])
    jpegs, mapped, from_copies = split.read_windows([0, 0, 0], boxes, side // 2)
    assert from_copies.tolist() == [True, False, False]
    assert jpegs[0].tobytes() == split.read(0, half=True).tobytes()
    assert mapped[0].tolist() == [0, 0, (side + 1) // 2, (side + 1) // 2]
    assert jpegs[1].tobytes() == split.read(0).tobytes() and mapped[1].tolist() == boxes[1].tolist()  # under twice
    assert jpegs[2].tobytes() == split.read(0).tobytes() and mapped[2].tolist() == boxes[2].tolist()


def test_pipeline_pixels_from_copies_match_the_images_decoded_at_scale_half(tmp_path: Path) -> None:
    plain = ShardDataset.open("p", build_sample_shards(tmp_path, classes=2, train_per_class=8)).splits["train"]
    halves = ShardDataset.open("h", build_sample_shards(tmp_path, classes=2, train_per_class=8,
                                                       half_copies=True)).splits["train"]
    assert plain.keys == halves.keys
    rows, size = np.arange(len(plain)), 24
    crops = sample_crops(AugmentKind.TRAIN, 0, 0, [plain.keys[i] for i in rows], plain.widths, plain.heights,
                         CropRange(min_scale=0.5))
    jpegs, boxes, _ = halves.read_windows(rows, crops.boxes, size)
    used = np.array([j.size != p.size for j, p in zip(jpegs, plain.read_many(rows))])
    assert used.sum() >= len(rows) // 2, "most windows are at least twice 24 px"
    runner = PipelineRunner(PipelineSpec(threads=1, max_batch_size=len(rows)))
    try:
        from_copies = runner.run(Job(jpegs, size, Crops(boxes=boxes, flips=crops.flips))).astype(np.int16)
        from_images = runner.run(Job(plain.read_many(rows), size, crops)).astype(np.int16)
    finally:
        runner.close()
    assert (from_copies[~used] == from_images[~used]).all()
    # Both are downscales of the window: each as far from an area-averaged resize of
    # the fully decoded window as the other (on these small, detailed photos a 24 px
    # output differs from it by several levels either way).
    reference = np.stack([_area_resized(plain.read(i), crops.boxes[i], crops.flips[i], size) for i in rows])
    error_copies = np.abs(from_copies[used] - reference[used]).mean()
    error_images = np.abs(from_images[used] - reference[used]).mean()
    assert error_copies < error_images + 1.0, (error_copies, error_images)


def _area_resized(data: np.ndarray, box: np.ndarray, flip: bool, size: int) -> np.ndarray:
    x, y, w, h = (int(v) for v in box)
    image = cv2.cvtColor(cv2.imdecode(data, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    out = cv2.resize(image[y : y + h, x : x + w], (size, size), interpolation=cv2.INTER_AREA)
    return (out[:, ::-1] if flip else out).astype(np.int16)

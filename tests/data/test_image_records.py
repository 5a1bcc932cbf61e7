"""Records with images: loading, the checks (one line naming the record) and the files."""

import json

import numpy as np
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests._helpers import raises_naming
from tunelib.data import (
    IMAGE_REASONS,
    REASONS,
    ImageError,
    RecordError,
    load_image,
    read_image_records,
    validate_image_records,
    write_image_records,
)

ASK = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}
ANSWER = {"role": "assistant", "content": "3"}


def sft(images, messages=None):
    return {"images": images, "messages": messages or [ASK, ANSWER]}


@pytest.fixture
def folder(tmp_path):
    """A data folder with good and bad image files beside it."""
    (tmp_path / "img").mkdir()
    rng = np.random.default_rng(0)
    PIL.Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(
        tmp_path / "img" / "rgb.png"
    )
    PIL.Image.fromarray(rng.integers(0, 256, (4, 4), dtype=np.uint8)).save(
        tmp_path / "img" / "grey.png"
    )
    PIL.Image.fromarray(rng.integers(0, 60000, (4, 4), dtype=np.uint16)).save(
        tmp_path / "img" / "deep.png"
    )
    (tmp_path / "img" / "text.png").write_text("not an image")
    good = (tmp_path / "img" / "rgb.png").read_bytes()
    (tmp_path / "img" / "cut.png").write_bytes(good[: len(good) // 2])
    return tmp_path


def test_load_image_converts_to_rgb_as_transformers(folder):
    rgb = load_image("img/rgb.png", root=folder)
    assert rgb.shape == (6, 5, 3) and rgb.dtype == np.uint8
    grey = load_image(folder / "img" / "grey.png")
    assert grey.shape == (4, 4, 3) and (grey == grey[..., :1]).all()
    # Transparency composited onto white: opaque keeps the colour, clear is white.
    rgba = np.array([[[10, 20, 30, 255], [10, 20, 30, 0]]], np.uint8)
    assert load_image(rgba).tolist() == [[[10, 20, 30], [255, 255, 255]]]
    assert load_image(PIL.Image.fromarray(rgba)).tolist() == [[[10, 20, 30], [255, 255, 255]]]
    data = (folder / "img" / "rgb.png").read_bytes()
    np.testing.assert_array_equal(load_image({"bytes": data, "path": None}), rgb)
    np.testing.assert_array_equal(
        load_image({"bytes": None, "path": "img/rgb.png"}, root=folder), rgb
    )


@pytest.mark.parametrize(
    "source, reason, named",
    [
        ("img/none.png", "missing_image", "no image file"),
        ("img/text.png", "undecodable_image", "not a readable image"),
        ("img/cut.png", "undecodable_image", "not a readable image"),
        ("img/deep.png", "bad_image", "mode 'I;16'"),
        (np.zeros((0, 4, 3), np.uint8), "bad_image", "no pixels"),
        (np.zeros((4, 4, 3), np.float32), "bad_image", "uint8"),
        (np.zeros((4, 4, 2), np.uint8), "bad_image", "[4, 4, 2]"),
        (7, "bad_image", "int"),
    ],
)
def test_bad_images_say_why(folder, source, reason, named):
    with raises_naming(named, error=ImageError) as info:
        load_image(source, root=folder)
    assert info.value.reason == reason and reason in IMAGE_REASONS


def test_each_invalid_record_is_one_line_naming_it(folder):
    """Every problem raises on its own, in one line that names the record and the image."""
    cases = [
        (sft(["img/none.png"]), "missing_image", "images[0]: no image file"),
        (
            sft(["img/rgb.png", "img/text.png"], [ASK, ASK, ANSWER]),
            "undecodable_image",
            "images[1]:",
        ),
        (sft(["img/rgb.png", "img/rgb.png"]), "image_count", "holds 2 images but 'messages' has 1"),
        (sft([]), "image_count", "holds 0 images"),
        (sft(["img/deep.png"]), "bad_image", "mode 'I;16'"),
        (sft([np.zeros((3, 0), np.uint8)]), "bad_image", "no pixels"),
        ({"messages": [ASK, ANSWER]}, "missing_field", "'images' is missing"),
        (sft("img/rgb.png"), "wrong_type", "must be a list"),
        (sft(["img/rgb.png"], [ASK]), "no_assistant", "no assistant"),
        (
            sft(["img/rgb.png"], [{"role": "user", "content": [{"type": "video"}]}, ANSWER]),
            "bad_content",
            "messages[0].content[0]",
        ),
    ]
    good = sft(["img/rgb.png"])
    for record, reason, named in cases:
        with raises_naming("record 1: ", named, error=RecordError) as info:
            validate_image_records([good, record], root=folder)
        assert info.value.reason == reason and "\n" not in str(info.value)
        assert reason in IMAGE_REASONS + REASONS
    records = [good] + [record for record, _, _ in cases]
    kept, report = validate_image_records(records, root=folder, on_invalid="skip")
    assert len(kept) == 1 and report.num_skipped == len(cases)
    assert kept[0]["images"] == [str(folder / "img" / "rgb.png")]


def test_rl_records_and_arrays():
    image = np.full((5, 7, 3), 200, np.uint8)
    record = {"images": [image], "prompt": [ASK], "answer": "3"}
    (kept,), report = validate_image_records([record], kind="rl")
    assert kept["images"][0] is image and report.kept == 1
    with raises_naming("record 0", "'answer' is missing"):
        validate_image_records([{"images": [image], "prompt": [ASK]}], kind="rl")
    with raises_naming("kind", "'sft'", "'rl'"):
        validate_image_records([record], kind="preference")


def test_files_name_the_line_or_row(folder):
    lines = [sft(["img/rgb.png"]), sft(["img/grey.png"]), sft(["img/none.png"])]
    path = folder / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines[:2]) + "\n\n" + json.dumps(lines[2]))
    with raises_naming(
        "record 2: line 4 of data.jsonl: images[0]: no image file", error=RecordError
    ):
        read_image_records(path)
    records, report = read_image_records(path, on_invalid="skip")
    assert [r["images"] for r in records] == [
        [str(folder / "img" / "rgb.png")],
        [str(folder / "img" / "grey.png")],
    ]
    assert dict(report.skipped) == {"missing_image": 1}
    # Parquet, with images as Hugging Face datasets' {"bytes", "path"} structs (a column
    # has one type: every content is a list of parts).
    data = (folder / "img" / "rgb.png").read_bytes()
    messages = [ASK, {"role": "assistant", "content": [{"type": "text", "text": "3"}]}]
    rows = [
        sft([{"bytes": data, "path": None}], messages),
        sft([{"bytes": b"not a png", "path": None}], messages),
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "data.parquet")
    with raises_naming("record 1: row 2 of data.parquet: images[0]:", "not a readable image"):
        read_image_records(folder / "data.parquet")
    with raises_naming("no data file", error=FileNotFoundError):
        read_image_records(folder / "none.jsonl")


def test_written_records_read_back_with_equal_pixels(tmp_path):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (5, 6, 3), dtype=np.uint8) for _ in range(3)]
    two = {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}
    records = [
        {"images": images[:2], "prompt": [two], "answer": "1"},
        {"images": [PIL.Image.fromarray(images[2])], "prompt": [ASK], "answer": "2"},
    ]
    path = write_image_records(records, tmp_path / "out" / "train.jsonl")
    read, report = read_image_records(path, kind="rl")
    assert report.kept == 2 and [r["answer"] for r in read] == ["1", "2"]
    pixels = [load_image(image) for record in read for image in record["images"]]
    for got, want in zip(pixels, images, strict=True):
        np.testing.assert_array_equal(got, want)
    assert json.loads(path.read_text().splitlines()[0])["images"] == [
        "train_images/0_0.png",
        "train_images/0_1.png",
    ]
    with raises_naming("exists", error=FileExistsError):
        write_image_records(records, path)
    with raises_naming(".jsonl"):
        write_image_records(records, tmp_path / "train.json")


def test_prompt_completion_records_count_the_images_of_both():
    image = np.zeros((4, 4, 3), np.uint8)
    show = {"role": "assistant", "content": [{"type": "text", "text": "see"}, {"type": "image"}]}
    record = {"images": [image, image], "prompt": [ASK], "completion": [show]}
    (kept,), _ = validate_image_records([record])
    assert len(kept["images"]) == 2
    with raises_naming("holds 1 images but 'prompt' and 'completion' have 2 image parts"):
        validate_image_records([{**record, "images": [image]}])

"""Records with images: `{"images": [...], "messages": [...]}`, checked record by record."""

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import PIL.Image

from tunelib.data._images import ImageError, load_image
from tunelib.data._records import (
    RecordError,
    RecordReport,
    check_kind,
    check_on_invalid,
    check_record,
    check_some_kept,
    collect,
    located_rows,
)

# Why an image record is invalid, besides the `REASONS` of its text (checked first).
IMAGE_REASONS = ("bad_content", "image_count", "missing_image", "undecodable_image", "bad_image")
# The kinds of image records, and the fields whose messages may hold images (in this order).
_KINDS = ("sft", "rl")
_CONVERSATIONS = ("messages", "prompt", "completion")


def _text_of(index: int, field: str, messages: list) -> tuple[list, int]:
    """`messages` with each list content reduced to its text parts joined, and the number of
    image parts: what the text checks of `check_record` read."""
    text_messages, images = [], 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            text_messages.append(message)
            continue
        texts = []
        for j, part in enumerate(content):
            where = f"{field}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image":
                images += 1
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise RecordError(
                    index,
                    where,
                    "bad_content",
                    f"{where} must be {{'type': 'image'}} or {{'type': 'text', 'text': str}}, "
                    f"got {part!r}",
                )
        text_messages.append({**message, "content": "".join(texts)})
    return text_messages, images


def check_image_record(
    index: int, record: Any, *, kind: str, root: Path | None = None, location: str = ""
) -> Mapping[str, Any]:
    """Raise a `RecordError` for the first problem of an image record; the record with its
    relative image paths made absolute (against `root`) otherwise."""
    if not isinstance(record, Mapping):
        raise RecordError(
            index, None, "not_a_dict", f"{location}expected a dict, got {type(record).__name__}"
        )
    images = record.get("images")
    if images is None:
        raise RecordError(index, "images", "missing_field", f"{location}field 'images' is missing")
    if not isinstance(images, list):
        raise RecordError(
            index,
            "images",
            "wrong_type",
            f"{location}field 'images' must be a list, got {type(images).__name__}",
        )
    text_record, markers, fields = dict(record), 0, []
    for field in _CONVERSATIONS:
        if isinstance(record.get(field), list):
            text_record[field], count = _text_of(index, field, record[field])
            markers += count
            fields.append(repr(field))
    try:
        check_record(index, text_record, kind)
    except RecordError as error:
        raise RecordError(index, error.field, error.reason, location + error.detail) from None
    if markers != len(images):
        raise RecordError(
            index,
            "images",
            "image_count",
            f"{location}field 'images' holds {len(images)} images but "
            f"{' and '.join(fields) or 'the record'} {'have' if len(fields) > 1 else 'has'} "
            f"{markers} image parts",
        )
    resolved = []
    for i, image in enumerate(images):
        try:
            load_image(image, root=root)
        except ImageError as error:
            raise RecordError(
                index, f"images[{i}]", error.reason, f"{location}images[{i}]: {error}"
            ) from None
        is_path = isinstance(image, (str, os.PathLike))
        resolved.append(str(root / image) if is_path and root is not None else image)
    return {**record, "images": resolved}


def validate_image_records(
    records: Iterable[Any],
    *,
    kind: Literal["sft", "rl"] = "sft",
    on_invalid: Literal["raise", "skip"] = "raise",
    root: str | os.PathLike | None = None,
) -> tuple[list[Mapping[str, Any]], RecordReport]:
    """Check records with images: their text as `validate_records`, then their images.

    The shapes (TRL's vision datasets):

    * `kind="sft"`: `{"images": [...], "messages": [...]}`, or `{"images", "prompt",
      "completion"}` with conversations;
    * `kind="rl"`: `{"images": [...], "prompt": [...], "answer": str}`.

    A message's content is a string, or a list of parts `{"type": "image"}` (where an image
    goes: the chat template writes its marker there) and `{"type": "text", "text": str}`.
    The images, in the order of their parts, are what `load_image` reads: paths (relative
    to `root`), PIL images, uint8 arrays or `{"bytes", "path"}` dicts. Each image is decoded
    to check it.

    A record is invalid, counted under the first reason that applies, for any of
    `validate_records`' reasons (the text parts of a list content read as its text), or when
    it

    * has a content part that is neither an image nor a text part (`"bad_content"`),
    * lacks `images` or holds None there (`"missing_field"`), or not a list (`"wrong_type"`),
    * has a number of images other than its number of image parts (`"image_count"`),
    * names an image file that does not exist (`"missing_image"`),
    * names a file that is not a readable image (`"undecodable_image"`),
    * or has an image of a mode other than 8-bit grey, palette or colour (16-bit, 32-bit or
      float pixels), an array that is not uint8 `[H, W]` or `[H, W, C]` (C in 1, 3, 4), or an
      image with no pixels (`"bad_image"`).

    Args:
      records: the records, any iterable.
      kind: `"sft"` or `"rl"`.
      on_invalid: `"raise"` (a `RecordError` for the first invalid record) or `"skip"`.
      root: the folder relative image paths are read from (None: the working directory).

    Returns:
      `(kept, report)`: the valid records in input order, each a new dict whose relative
      image paths are joined to `root`, and the `RecordReport`.

    Raises:
      RecordError: a `ValueError` whose one-line message names the record and the problem,
        e.g. `"record 2: images[0]: no image file data/img/7.png"`.

    Examples:
      >>> import numpy as np
      >>> from tunelib.data import validate_image_records
      >>> ask = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Why?"}]}
      >>> answer = {"role": "assistant", "content": "Because."}
      >>> black = np.zeros((4, 4, 3), np.uint8)
      >>> records = [
      ...     {"images": [black], "messages": [ask, answer]},
      ...     {"images": [black, black], "messages": [ask, answer]},
      ...     {"images": ["no/such.png"], "messages": [ask, answer]},
      ...     {"images": [np.zeros((4, 4), np.float32)], "messages": [ask, answer]},
      ... ]
      >>> kept, report = validate_image_records(records, on_invalid="skip")
      >>> len(kept), dict(report.skipped)
      (1, {'image_count': 1, 'missing_image': 1, 'bad_image': 1})
      >>> try:
      ...     validate_image_records(records[1:])
      ... except ValueError as error:
      ...     print(error)
      record 0: field 'images' holds 2 images but 'messages' has 1 image parts
    """
    check_kind(kind, _KINDS)
    check_on_invalid(on_invalid)
    folder = None if root is None else Path(root)
    return collect(
        records,
        on_invalid,
        lambda index, record: check_image_record(index, record, kind=kind, root=folder),
    )


def read_image_records(
    path: str | os.PathLike,
    *,
    kind: Literal["sft", "rl"] = "sft",
    on_invalid: Literal["raise", "skip"] = "raise",
) -> tuple[list[Mapping[str, Any]], RecordReport]:
    """Read and check the image records of a JSON-lines, JSON or Parquet file.

    The file is read as `read_records` reads it, and every record is checked as
    `validate_image_records(kind=kind, root=<the file's folder>)` checks it: image paths are
    relative to the data file (or absolute), and an error names the record by its number
    and by its line (JSON lines), element (a JSON array) or row (Parquet), counted from 1,
    e.g. `"record 3: line 4 of data.jsonl: images[0]: no image file /data/img/3.png"`.
    In Parquet an image may also be a `{"bytes", "path"}` struct, as Hugging Face datasets
    writes an image column.

    Args:
      path: the file; its suffix (`.jsonl`, `.json`, `.parquet`) picks the reader.
      kind: `"sft"` or `"rl"` (see `validate_image_records`).
      on_invalid: `"raise"` or `"skip"`.

    Returns:
      `(records, report)`, as `validate_image_records`, with image paths made absolute;
      at least one record.

    Raises:
      FileNotFoundError: for a missing file.
      ValueError: for an unknown suffix, or a file with no (valid) record.
      RecordError: for an invalid record with `on_invalid="raise"`.

    Examples:
      >>> import json, tempfile
      >>> from pathlib import Path
      >>> from tunelib.data import read_image_records
      >>> folder = Path(tempfile.mkdtemp())
      >>> ask = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}
      >>> record = {"images": ["img/0.png"], "prompt": [ask], "answer": "3"}
      >>> _ = (folder / "rl.jsonl").write_text(json.dumps(record) + "\\n")
      >>> try:
      ...     read_image_records(folder / "rl.jsonl", kind="rl")
      ... except ValueError as error:
      ...     print(str(error).replace(str(folder), "DATA"))
      record 0: line 1 of rl.jsonl: images[0]: no image file DATA/img/0.png
    """
    check_kind(kind, _KINDS)
    check_on_invalid(on_invalid)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file {path}.")
    root = path.parent

    def check(index: int, row: tuple[str, Any]) -> Mapping[str, Any]:
        location, record = row
        if isinstance(record, RecordError):
            raise record
        where = f"{location} of {path.name}: "
        return check_image_record(index, record, kind=kind, root=root, location=where)

    records, report = collect(located_rows(path), on_invalid, check)
    check_some_kept(path, kind, records, report)
    return records, report


def write_image_records(records: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Save image records as a JSON-lines file and PNG files, to be read as a user's data.

    Each image that is an array or a PIL image is saved as `<stem>_images/<r>_<i>.png`
    beside the file (`r` the record's number, `i` the image's, from 0) and written as that
    path relative to the file; an image that is already a path is written as it is. The
    other fields are written as they are (they must be JSON). `read_image_records(path)`
    reads the records back, the pixels equal.

    Args:
      records: image records, as from `vision_counting_split`.
      path: the `.jsonl` file to write; it and the image folder must not exist yet.

    Returns:
      `path`, as a `Path`.

    Raises:
      FileExistsError: when `path` or its image folder exists.
      ValueError: for a path not ending in `.jsonl`, or a record without an `images` list.

    Examples:
      >>> import json, tempfile
      >>> import numpy as np
      >>> from pathlib import Path
      >>> from tunelib.data import read_image_records, write_image_records
      >>> ask = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}
      >>> grey = np.full((4, 4, 3), 128, np.uint8)
      >>> records = [{"images": [grey], "prompt": [ask], "answer": "0"}]
      >>> path = write_image_records(records, Path(tempfile.mkdtemp()) / "train.jsonl")
      >>> json.loads(path.read_text())["images"]
      ['train_images/0_0.png']
      >>> records, report = read_image_records(path, kind="rl")
      >>> report.kept, records[0]["images"][0].endswith("train_images/0_0.png")
      (1, True)
    """
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise ValueError(f"path must end in .jsonl, got {path.name!r}.")
    folder = path.with_name(f"{path.stem}_images")
    for existing in (path, folder):
        if existing.exists():
            raise FileExistsError(f"{existing} exists; choose a new path or remove it first.")
    folder.mkdir(parents=True)
    with path.open("w", encoding="utf-8") as f:
        for r, record in enumerate(records):
            images = record.get("images") if isinstance(record, Mapping) else None
            if not isinstance(images, list):
                raise ValueError(f"record {r} has no 'images' list.")
            names = []
            for i, image in enumerate(images):
                if isinstance(image, (str, os.PathLike)):
                    names.append(str(image))
                    continue
                name = f"{folder.name}/{r}_{i}.png"
                picture = (
                    image if isinstance(image, PIL.Image.Image) else PIL.Image.fromarray(image)
                )
                picture.save(path.parent / name)
                names.append(name)
            f.write(json.dumps({**record, "images": names}) + "\n")
    return path

"""Records in the usual Hugging Face shapes, from JSON-lines or Parquet files, checked."""

import collections
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from tunelib.data._records import OnInvalid, RecordError, RecordReport, check_on_invalid

HFRecordKind = Literal["sft", "preference", "rl"]
# Why a record is invalid, in the order the checks run (a record counts under its first reason).
HF_REASONS = (
    "bad_json",
    "not_a_dict",
    "missing_field",
    "wrong_type",
    "bad_message",
    "empty",
    "no_assistant",
    "mixed_formats",
    "template_error",
    "too_long",
)
ROLES = ("system", "user", "assistant", "tool")


def _missing(record: Mapping[str, Any], field: str) -> bool:
    # Parquet fills a column a record lacks with null, so a None value counts as missing.
    return record.get(field) is None


def check_messages(index: int, field: str, value: Any) -> None:
    """A conversation: a non-empty list of {"role", "content"} dicts with known roles."""
    if not isinstance(value, list):
        raise RecordError(
            index,
            field,
            "wrong_type",
            f"field {field!r} must be a string or a list of messages, got {type(value).__name__}",
        )
    if not value:
        raise RecordError(index, field, "empty", f"field {field!r} is an empty conversation")
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise RecordError(
                index, where, "bad_message", f"{where} must be a dict, got {type(message).__name__}"
            )
        role = message.get("role")
        if role not in ROLES:
            raise RecordError(
                index,
                f"{where}.role",
                "bad_message",
                f"{where}.role must be one of {ROLES}, got {role!r}",
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise RecordError(
                index,
                f"{where}.content",
                "bad_message",
                f"{where}.content must be a str, got {type(content).__name__}",
            )


def _kind_of(index: int, record: Mapping[str, Any], field: str) -> str:
    """ "text" for a string field, "chat" for a conversation; raises for anything else."""
    value = record[field]
    if isinstance(value, str):
        return "text"
    check_messages(index, field, value)
    return "chat"


def check_hf_record(index: int, record: Any, kind: HFRecordKind) -> str:
    """Raise a `RecordError` for the first problem of `record`; return "text" or "chat"."""
    if not isinstance(record, Mapping):
        raise RecordError(
            index, None, "not_a_dict", f"expected a dict, got {type(record).__name__}"
        )
    if kind == "sft" and not _missing(record, "messages"):
        check_messages(index, "messages", record["messages"])
        if not any(m["role"] == "assistant" for m in record["messages"]):
            raise RecordError(
                index, "messages", "no_assistant", "field 'messages' has no assistant message"
            )
        return "chat"
    fields = {
        "sft": ("prompt", "completion"),
        "preference": ("prompt", "chosen", "rejected"),
        "rl": ("prompt", "answer"),
    }[kind]
    for field in fields:
        if _missing(record, field):
            hint = " (or give 'messages')" if kind == "sft" else ""
            raise RecordError(index, field, "missing_field", f"field {field!r} is missing{hint}")
    if kind == "rl":
        if not isinstance(record["answer"], str):
            found = type(record["answer"]).__name__
            raise RecordError(
                index, "answer", "wrong_type", f"field 'answer' must be a str, got {found}"
            )
        fields = ("prompt",)
    formats = {field: _kind_of(index, record, field) for field in fields}
    if len(set(formats.values())) > 1:
        raise RecordError(
            index,
            fields[1] if len(fields) > 1 else fields[0],
            "mixed_formats",
            f"fields {list(fields)} mix strings and conversations: {formats}",
        )
    for field in fields[1:]:
        if formats[field] == "text" and not record[field]:
            raise RecordError(index, field, "empty", f"field {field!r} is empty")
    if kind == "rl" and formats["prompt"] == "text" and not record["prompt"]:
        raise RecordError(index, "prompt", "empty", "field 'prompt' is empty")
    return formats[fields[0]]


def validate_hf_records(
    records: Iterable[Any], *, kind: HFRecordKind, on_invalid: OnInvalid = "raise"
) -> tuple[list[Mapping[str, Any]], RecordReport]:
    """Check records in the usual Hugging Face shapes; raise on, or drop, the invalid ones.

    The shapes (as TRL's dataset formats):

    * `kind="sft"`: `{"messages": [...]}` (a conversation with at least one assistant
      message), or `{"prompt", "completion"}`, both strings or both conversations;
    * `kind="preference"`: `{"prompt", "chosen", "rejected"}`, all strings or all
      conversations (the prompt's messages, then each response's);
    * `kind="rl"`: `{"prompt", "answer"}` for verifiable rewards: the prompt a string or a
      conversation, the answer a string.

    A conversation is a non-empty list of `{"role", "content"}` dicts, the role one of
    "system", "user", "assistant", "tool" and the content a string. A field whose value is
    None counts as missing (Parquet writes null for a column a record lacks); other fields
    are kept. Reasons, in the order they are checked: `"not_a_dict"`, `"missing_field"`,
    `"wrong_type"`, `"bad_message"`, `"empty"` (a conversation with no message, or an empty
    completion / response / RL prompt), `"no_assistant"`, `"mixed_formats"`.

    Args:
      records: the records.
      kind: `"sft"`, `"preference"` or `"rl"`.
      on_invalid: `"raise"` raises a `RecordError` for the first invalid record; `"skip"`
        drops it and counts it in the report.

    Returns:
      `(kept, report)`: the valid records, in input order, and a `RecordReport`.

    Raises:
      RecordError: naming the record index and the field, e.g.
        `"record 3: messages[1].role must be one of (...), got 'bot'"`.

    Examples:
      >>> from tunelib.data import validate_hf_records
      >>> records = [
      ...     {"messages": [{"role": "user", "content": "hi"},
      ...                   {"role": "assistant", "content": "hello"}]},
      ...     {"messages": [{"role": "user", "content": "hi"}]},
      ...     {"prompt": "2+2=", "completion": ""},
      ... ]
      >>> kept, report = validate_hf_records(records, kind="sft", on_invalid="skip")
      >>> len(kept), dict(report.skipped)
      (1, {'no_assistant': 1, 'empty': 1})
    """
    if kind not in ("sft", "preference", "rl"):
        raise ValueError(f"kind must be 'sft', 'preference' or 'rl', got {kind!r}.")
    check_on_invalid(on_invalid)
    kept = []
    skipped: collections.Counter[str] = collections.Counter()
    for index, record in enumerate(records):
        try:
            if isinstance(record, RecordError):  # a line of a file that did not parse
                raise record
            check_hf_record(index, record, kind)
        except RecordError as error:
            if on_invalid == "raise":
                raise
            skipped[error.reason] += 1
        else:
            kept.append(record)
    return kept, RecordReport(kept=len(kept), skipped=skipped)


def _json(path: Path) -> Iterator[Any]:
    """The records of a JSON-lines file, or of a `.json` file holding one JSON array."""
    if path.suffix.lower() == ".json":
        with path.open(encoding="utf-8") as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            try:
                records = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} is not a JSON array: {error}.") from None
            yield from records
            return
    with path.open(encoding="utf-8") as f:
        index = 0
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                yield RecordError(
                    index, None, "bad_json", f"line {line_number} of {path} is not JSON: {error}"
                )
            index += 1


def _parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches():
        yield from batch.to_pylist()


def read_records(
    path: str | os.PathLike,
    *,
    kind: HFRecordKind,
    on_invalid: OnInvalid = "raise",
) -> tuple[list[Mapping[str, Any]], RecordReport]:
    """Read and check the records of a JSON-lines (`.jsonl`) or Parquet (`.parquet`) file.

    JSON lines hold one JSON object per line (blank lines are skipped; a line that is not
    JSON is invalid with reason `"bad_json"`); a `.json` file may instead hold one JSON array
    of records; Parquet rows become dicts (struct columns
    dicts, list columns lists), read a row group at a time. Every record is then checked as
    `validate_hf_records(kind=kind)` does; records are numbered from 0 in file order, so
    `"record 17"` is the 18th non-blank line or row.

    Args:
      path: the file; its suffix (`.jsonl`, `.json`, `.parquet`) picks the reader.
      kind: `"sft"`, `"preference"` or `"rl"` (see `validate_hf_records`).
      on_invalid: `"raise"` or `"skip"` (count and drop invalid records).

    Returns:
      `(records, report)`, as `validate_hf_records`.

    Raises:
      FileNotFoundError: for a missing file; ValueError: for an unknown suffix;
      RecordError: for an invalid record with `on_invalid="raise"`.

    Examples:
      >>> import json, tempfile
      >>> from tunelib.data import read_records
      >>> path = tempfile.mkdtemp() + "/rl.jsonl"
      >>> with open(path, "w") as f:
      ...     _ = f.write(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\\n")
      ...     _ = f.write(json.dumps({"prompt": "2+2="}) + "\\n")
      >>> try:
      ...     read_records(path, kind="rl")
      ... except ValueError as error:
      ...     print(error)
      record 1: field 'answer' is missing
      >>> records, report = read_records(path, kind="rl", on_invalid="skip")
      >>> records, dict(report.skipped)
      ([{'prompt': '1+1=', 'answer': '2'}], {'missing_field': 1})
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file {path}.")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _json(path)
    elif suffix == ".parquet":
        rows = _parquet(path)
    else:
        raise ValueError(f"path must end in .jsonl, .json or .parquet, got {path.name!r}.")
    return validate_hf_records(rows, kind=kind, on_invalid=on_invalid)

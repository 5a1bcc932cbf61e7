"""Records in the usual Hugging Face shapes: their checks, their files and their token sequences."""

import collections
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tunelib.data._chat_template import TemplateError, encode_chat
from tunelib.data._tokenizers import Tokenizer

RecordKind = Literal["sft", "preference", "rl"]
OnInvalid = Literal["raise", "skip"]
# The fields of each kind of record (an SFT record may give "messages" instead); the ones
# after "prompt" are what a model learns to produce (for RL, the answer a verifier checks).
FIELDS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "rl": ("prompt", "answer"),
}
# Why a record is invalid, in about the order the checks run; a record counts under the first
# reason its checks find.
REASONS = (
    "bad_json",
    "not_a_dict",
    "missing_field",
    "not_a_string",
    "wrong_type",
    "bad_message",
    "empty",
    "no_assistant",
    "mixed_formats",
    "unknown_character",
    "template_error",
    "too_long",
)
ROLES = ("system", "user", "assistant", "tool")
# A tokenized record: `{"ids": [N] int32, "where": [N] bool}` (SFT), one such dict per side
# under "chosen" and "rejected" (preference), or `{"ids": [N] int32}` (an RL prompt).
Example = dict[str, Any]


class RecordError(ValueError):
    """An invalid record: the message names the record index and the field.

    Attributes:
      index: position of the record in the input.
      field: the offending field (`"messages[1].role"` inside a conversation), or None when
        the record is not a dict or not JSON.
      reason: one of `REASONS`, the key it is counted under when skipping.
      detail: the message without the record index.
    """

    def __init__(self, index: int, field: str | None, reason: str, detail: str):
        super().__init__(f"record {index}: {detail}")
        self.index = index
        self.field = field
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class RecordReport:
    """What a check kept and skipped.

    Attributes:
      kept: number of valid records.
      skipped: number of invalid records per reason (a `collections.Counter`: a reason that
        did not occur reads as 0); the reasons are `REASONS`.
    """

    kept: int
    skipped: dict[str, int]

    @property
    def num_skipped(self) -> int:
        """Total number of records skipped."""
        return sum(self.skipped.values())


def check_max_length(max_length: int, *, at_least: int) -> None:
    if max_length < at_least:
        raise ValueError(f"max_length must be >= {at_least}, got {max_length}.")


def check_on_invalid(on_invalid: str) -> None:
    if on_invalid not in ("raise", "skip"):
        raise ValueError(f"on_invalid must be 'raise' or 'skip', got {on_invalid!r}.")


def check_kind(kind: str, kinds: Iterable[str]) -> None:
    kinds = tuple(kinds)
    if kind not in kinds:
        names = ", ".join(repr(k) for k in kinds[:-1]) + f" or {kinds[-1]!r}"
        raise ValueError(f"kind must be {names}, got {kind!r}.")


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


def _format(index: int, record: Mapping[str, Any], field: str) -> str:
    """ "text" for a string field, "chat" for a conversation; raises for anything else."""
    value = record[field]
    if isinstance(value, str):
        return "text"
    check_messages(index, field, value)
    return "chat"


def check_record(index: int, record: Any, kind: str) -> str:
    """Raise a `RecordError` for the first problem of `record`'s shape; "text" or "chat"."""
    if not isinstance(record, Mapping):
        raise RecordError(
            index, None, "not_a_dict", f"expected a dict, got {type(record).__name__}"
        )
    # Parquet fills a column a record lacks with null, so a None value counts as missing.
    if kind == "sft" and record.get("messages") is not None:
        check_messages(index, "messages", record["messages"])
        if not any(m["role"] == "assistant" for m in record["messages"]):
            raise RecordError(
                index, "messages", "no_assistant", "field 'messages' has no assistant message"
            )
        return "chat"
    fields = FIELDS[kind]
    for field in fields:
        if record.get(field) is None:
            hint = " (or give 'messages')" if kind == "sft" else ""
            raise RecordError(index, field, "missing_field", f"field {field!r} is missing{hint}")
    if kind == "rl":
        if not isinstance(record["answer"], str):
            found = type(record["answer"]).__name__
            raise RecordError(
                index, "answer", "not_a_string", f"field 'answer' must be a str, got {found}"
            )
        fields = ("prompt",)
    formats = {field: _format(index, record, field) for field in fields}
    if len(set(formats.values())) > 1:
        raise RecordError(
            index,
            fields[1],
            "mixed_formats",
            f"fields {list(fields)} mix strings and conversations: {formats}",
        )
    for field in fields[1:]:
        if formats[field] == "text" and not record[field]:
            raise RecordError(index, field, "empty", f"field {field!r} is empty")
    if kind == "rl" and formats["prompt"] == "text" and not record["prompt"]:
        raise RecordError(index, "prompt", "empty", "field 'prompt' is empty")
    return formats[fields[0]]


def _text_ids(index: int, field: str, text: str, encode: Callable[[str], list[int]]) -> list[int]:
    try:
        return encode(text)
    except ValueError as error:
        raise RecordError(index, field, "unknown_character", f"field {field!r}: {error}") from None


def _chat(index: int, field: str, tokenizer: Tokenizer, messages: list, **kwargs: Any) -> tuple:
    try:
        return encode_chat(tokenizer, messages, **kwargs)
    except TemplateError as error:
        raise RecordError(index, field, "template_error", f"field {field!r}: {error}") from None


def prompt_ids(prompt: str | list, tokenizer: Tokenizer) -> list[int]:
    """A prompt to sample from: `[BOS] + prompt` (BOS when `tokenizer.add_bos`), or a
    conversation rendered with the chat template and the generation prompt.

    Raises `ValueError` (or its `TemplateError`) when the tokenizer cannot encode it.
    """
    if isinstance(prompt, str):
        head = [tokenizer.bos_id] if tokenizer.add_bos else []
        return head + tokenizer.encode(prompt)
    if tokenizer.chat_template is None:
        raise ValueError("the prompt is a conversation, but the tokenizer has no chat template.")
    return encode_chat(tokenizer, prompt, add_generation_prompt=True)[0].tolist()


def _rl_prompt(
    index: int, prompt: str | list, tokenizer: Tokenizer, max_length: int | None
) -> list:
    """The ids of an RL record's prompt, as `encode_prompts` lays it out."""
    try:
        ids = prompt_ids(prompt, tokenizer)
    except TemplateError as error:
        raise RecordError(index, "prompt", "template_error", f"field 'prompt': {error}") from None
    except ValueError as error:
        raise RecordError(
            index, "prompt", "unknown_character", f"field 'prompt': {error}"
        ) from None
    if max_length is not None and len(ids) > max_length:
        raise RecordError(
            index,
            "prompt",
            "too_long",
            f"field 'prompt' needs {len(ids)} tokens, more than max_length={max_length}",
        )
    return ids


def _sequences(
    index: int, record: Mapping[str, Any], fmt: str, sides: tuple[str, ...], tokenizer: Tokenizer
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, str]]:
    """Per side, the ids and the completion mask of the prompt followed by that side, and
    (for strings) how its length adds up."""
    sequences, parts = {}, {}
    if fmt == "text":
        head = [tokenizer.bos_id] if tokenizer.add_bos else []
        prompt = [*head, *_text_ids(index, "prompt", record["prompt"], tokenizer.encode)]
        for field in sides:
            completion = _text_ids(index, field, record[field], tokenizer.encode)
            ids = np.asarray([*prompt, *completion, tokenizer.eos_id], np.int32)
            sequences[field] = (ids, np.arange(len(ids)) >= len(prompt))
            parts[field] = (
                f"{'BOS + ' if head else ''}prompt ({len(prompt) - len(head)}) + "
                f"{field} ({len(completion)}) + EOS "
            )
    elif sides == ("messages",):
        sequences["messages"] = _chat(index, "messages", tokenizer, record["messages"])
    else:
        prompt_messages = list(record["prompt"])
        for field in sides:
            messages = prompt_messages + list(record[field])
            sequences[field] = _chat(
                index, field, tokenizer, messages, prompt_length=len(prompt_messages)
            )
    return sequences, parts


def encode_record(
    index: int,
    record: Any,
    *,
    kind: str,
    tokenizer: Tokenizer,
    max_length: int | None,
    packed: bool = False,
) -> Example:
    """Check `record` and tokenize it (see `encode_records`); a `RecordError` if invalid.

    With `packed`, the two sides of a pair must also fit one row together: their next-token
    layouts (each a token shorter than its sequence) sum to at most `max_length`.
    """
    fmt = check_record(index, record, kind)
    if kind == "rl":
        sides = ("prompt",)
    elif kind == "sft":
        sides = ("completion",) if record.get("messages") is None else ("messages",)
    else:
        sides = ("chosen", "rejected")
    if fmt == "chat" and tokenizer.chat_template is None:
        raise RecordError(
            index,
            sides[0],
            "template_error",
            f"field {sides[0]!r} is a conversation, but the tokenizer has no chat template",
        )
    if kind == "rl":
        return {
            "ids": np.asarray(_rl_prompt(index, record["prompt"], tokenizer, max_length), np.int32)
        }
    sequences, parts = _sequences(index, record, fmt, sides, tokenizer)
    for field, (_, where) in sequences.items():
        if not where[1:].any():
            raise RecordError(
                index, field, "empty", f"field {field!r} gives no token to learn after the first"
            )
    for field, (ids, _) in sequences.items():
        if max_length is not None and len(ids) > max_length:
            raise RecordError(
                index,
                field,
                "too_long",
                f"field {field!r} makes the sequence {parts.get(field, '')}{len(ids)} tokens "
                f"long, more than max_length={max_length}",
            )
    if packed and kind == "preference" and max_length is not None:
        columns = [len(ids) - 1 for ids, _ in sequences.values()]
        if sum(columns) > max_length:
            raise RecordError(
                index,
                "rejected",
                "too_long",
                f"fields 'chosen' and 'rejected' take {columns[0]} + {columns[1]} columns of a "
                f"packed row together, more than max_length={max_length}",
            )
    examples = {field: {"ids": ids, "where": where} for field, (ids, where) in sequences.items()}
    return examples[sides[0]] if kind == "sft" else examples


def collect(
    records: Iterable[Any], on_invalid: str, check: Callable[[int, Any], Any]
) -> tuple[list[Any], RecordReport]:
    """`check(index, record)` of every record: raise the first `RecordError`, or count it."""
    kept = []
    skipped: collections.Counter[str] = collections.Counter()
    for index, record in enumerate(records):
        try:
            if isinstance(record, RecordError):  # a line of a file that did not parse
                raise record
            kept.append(check(index, record))
        except RecordError as error:
            if on_invalid == "raise":
                raise
            skipped[error.reason] += 1
    return kept, RecordReport(kept=len(kept), skipped=skipped)


def validate_records(
    records: Iterable[Any],
    *,
    kind: RecordKind,
    on_invalid: OnInvalid = "raise",
    tokenizer: Tokenizer | None = None,
    max_length: int | None = None,
) -> tuple[list[Mapping[str, Any]], RecordReport]:
    """Check records in the usual Hugging Face shapes; raise on, or drop, the invalid ones.

    The shapes (TRL's dataset formats):

    * `kind="sft"`: `{"messages": [...]}` (a conversation with at least one assistant
      message), or `{"prompt", "completion"}`, both strings or both conversations;
    * `kind="preference"`: `{"prompt", "chosen", "rejected"}`, all strings or all
      conversations (the prompt's messages, then each response's);
    * `kind="rl"`: `{"prompt", "answer"}` for verifiable rewards: the prompt a string or a
      conversation, the answer a string.

    A conversation is a non-empty list of `{"role", "content"}` dicts, the role one of
    "system", "user", "assistant", "tool" and the content a string. A field whose value is
    None counts as missing (Parquet writes null for a column a record lacks); other fields
    are kept. With a `tokenizer`, each record is also tokenized as the pipelines will
    tokenize it (`encode_records`; an RL prompt as `encode_prompts` does), and with
    `max_length` its length is checked too.

    A record is invalid, counted under the first reason that applies, when it

    * is a line of a JSON-lines file that is not JSON (`"bad_json"`, from `read_records`),
    * is not a dict (`"not_a_dict"`),
    * lacks a field, or holds None there (`"missing_field"`),
    * has an `answer` that is not a string (`"not_a_string"`),
    * has a field that is neither a string nor a list of messages (`"wrong_type"`),
    * has a message that is not a dict, has an unknown role or no string content
      (`"bad_message"`),
    * has an empty completion, response, RL prompt or conversation, or, tokenized, no token
      to learn (`"empty"`),
    * has `messages` without an assistant turn (`"no_assistant"`),
    * mixes strings and conversations (`"mixed_formats"`),
    * has text the tokenizer cannot encode (`"unknown_character"`),
    * is a conversation the chat template fails on, or the tokenizer has no template
      (`"template_error"`),
    * or is longer than `max_length` tokens (`"too_long"`): `[BOS] + prompt + completion +
      EOS`, or the rendered conversation, for each side of a pair; an RL prompt as
      `encode_prompts` lays it out.

    An empty prompt is fine for SFT and preference strings.

    Args:
      records: the records, any iterable.
      kind: `"sft"`, `"preference"` or `"rl"`.
      on_invalid: `"raise"` (the default) raises a `RecordError` for the first invalid record;
        `"skip"` drops invalid records and counts them in the report.
      tokenizer: None (shapes only), or any `Tokenizer` to check the text against.
      max_length: None, or the most tokens a sequence may have, BOS and EOS included (needs
        a `tokenizer`).

    Returns:
      `(kept, report)`: the valid records in input order (the same objects), and a
      `RecordReport` with `kept` and the per-reason `skipped` counts.

    Raises:
      RecordError: a `ValueError` whose message names the record index and the field, e.g.
        `"record 17: field 'chosen' is empty"` or
        `"record 3: messages[1].role must be one of (...), got 'bot'"`.

    Examples:
      >>> from tunelib.data import CharTokenizer, validate_records
      >>> records = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "1+1="}, 7]
      >>> kept, report = validate_records(
      ...     records, kind="sft", tokenizer=CharTokenizer(), max_length=8, on_invalid="skip"
      ... )
      >>> len(kept), report.kept, dict(report.skipped)
      (1, 1, {'missing_field': 1, 'not_a_dict': 1})
      >>> try:
      ...     validate_records(records, kind="sft", tokenizer=CharTokenizer(), max_length=8)
      ... except ValueError as error:
      ...     print(error)
      record 1: field 'completion' is missing (or give 'messages')
      >>> chats = [
      ...     {"messages": [{"role": "user", "content": "hi"},
      ...                   {"role": "assistant", "content": "hello"}]},
      ...     {"messages": [{"role": "user", "content": "hi"}]},
      ...     {"prompt": "2+2=", "completion": ""},
      ... ]
      >>> kept, report = validate_records(chats, kind="sft", on_invalid="skip")
      >>> len(kept), dict(report.skipped)
      (1, {'no_assistant': 1, 'empty': 1})
    """
    check_kind(kind, FIELDS)
    check_on_invalid(on_invalid)
    if max_length is not None:
        if tokenizer is None:
            raise ValueError("max_length needs a tokenizer to count the tokens of a record.")
        check_max_length(max_length, at_least=2)

    def check(index: int, record: Any) -> Any:
        if tokenizer is None:
            check_record(index, record, kind)
        else:
            encode_record(index, record, kind=kind, tokenizer=tokenizer, max_length=max_length)
        return record

    return collect(records, on_invalid, check)


def encode_records(
    records: Iterable[Any],
    tokenizer: Tokenizer,
    *,
    kind: Literal["sft", "preference"],
    max_length: int,
    on_invalid: OnInvalid = "raise",
) -> tuple[list[Example], RecordReport]:
    """Check and tokenize SFT or preference records; each becomes ids and a completion mask.

    Every record is checked as `validate_records(kind=kind, tokenizer=tokenizer,
    max_length=max_length)` does, then tokenized:

    * strings as `[BOS] + prompt + completion + EOS` (BOS when `tokenizer.add_bos`), prompt
      and completion encoded separately, the mask on the completion and EOS;
    * a conversation (`messages`, or `prompt` and `completion` / `chosen` / `rejected` as
      lists of messages) by `encode_chat` with the tokenizer's chat template, the mask on
      the assistant turns (for `messages`) or on everything after the prompt.

    Args:
      records: `{"messages"}` or `{"prompt", "completion"}` dicts (`kind="sft"`), or
        `{"prompt", "chosen", "rejected"}` dicts (`kind="preference"`).
      tokenizer: any `Tokenizer` (one with a chat template for conversations).
      kind: `"sft"` or `"preference"`.
      max_length: the most tokens a sequence may have.
      on_invalid: `"raise"` (a `RecordError` naming the record index and field) or `"skip"`.

    Returns:
      `(examples, report)`: per kept record `{"ids": [N] int32, "where": [N] bool}` (SFT) or
      `{"chosen": {...}, "rejected": {...}}` (preference), and the `RecordReport`.

    Examples:
      >>> from tunelib.data import CharTokenizer, encode_records
      >>> records = [{"prompt": "1+1=", "completion": "2"}]
      >>> (example,), report = encode_records(records, CharTokenizer(), kind="sft", max_length=8)
      >>> print(example["ids"], example["where"].astype(int))
      [ 1  4 13  4 16  5  2] [0 0 0 0 0 1 1]
    """
    check_kind(kind, ("sft", "preference"))
    check_on_invalid(on_invalid)
    check_max_length(max_length, at_least=2)
    return collect(
        records,
        on_invalid,
        lambda index, record: encode_record(
            index, record, kind=kind, tokenizer=tokenizer, max_length=max_length
        ),
    )


def located_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """The records of a JSON-lines, JSON or Parquet file, each with where it is in the file
    ("line 4", "element 3", "row 2", counted from 1); a JSON line that does not parse comes
    as a `RecordError`."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _json(path)
    elif suffix == ".parquet":
        yield from _parquet(path)
    else:
        raise ValueError(f"path must end in .jsonl, .json or .parquet, got {path.name!r}.")


def _json(path: Path) -> Iterator[tuple[str, Any]]:
    """The records of a JSON-lines file, or of a `.json` file holding one JSON array."""
    if path.suffix.lower() == ".json":
        with path.open(encoding="utf-8") as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            try:
                records = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} is not a JSON array: {error}.") from None
            for number, record in enumerate(records, start=1):
                yield f"element {number}", record
            return
    with path.open(encoding="utf-8") as f:
        index = 0
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                record = RecordError(
                    index, None, "bad_json", f"line {line_number} of {path} is not JSON: {error}"
                )
            yield f"line {line_number}", record
            index += 1


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for record in batch.to_pylist():
            number += 1
            yield f"row {number}", record


def read_records(
    path: str | os.PathLike,
    *,
    kind: RecordKind,
    on_invalid: OnInvalid = "raise",
) -> tuple[list[Mapping[str, Any]], RecordReport]:
    """Read and check the records of a JSON-lines (`.jsonl`), JSON or Parquet file.

    JSON lines hold one JSON object per line (blank lines are skipped; a line that is not
    JSON is invalid with reason `"bad_json"`); a `.json` file may instead hold one JSON array
    of records; Parquet rows become dicts (struct columns dicts, list columns lists), read a
    row group at a time. Every record is then checked as `validate_records(kind=kind)` does;
    records are numbered from 0 in file order, so `"record 17"` is the 18th non-blank line or
    row.

    Args:
      path: the file; its suffix (`.jsonl`, `.json`, `.parquet`) picks the reader.
      kind: `"sft"`, `"preference"` or `"rl"` (see `validate_records`).
      on_invalid: `"raise"` or `"skip"` (count and drop invalid records).

    Returns:
      `(records, report)`, as `validate_records`; at least one record.

    Raises:
      FileNotFoundError: for a missing file.
      ValueError: for an unknown suffix, or a file with no record or (skipping) no valid
        record, naming the file.
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
    check_kind(kind, FIELDS)
    check_on_invalid(on_invalid)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file {path}.")
    rows = (record for _, record in located_rows(path))
    records, report = validate_records(rows, kind=kind, on_invalid=on_invalid)
    check_some_kept(path, kind, records, report)
    return records, report


def check_some_kept(path: Path, kind: str, records: list, report: RecordReport) -> None:
    """Raise when a file gave no valid record, naming it and what was skipped."""
    if not records:
        if report.num_skipped:
            raise ValueError(
                f"{path} holds no valid {kind} record: all {report.num_skipped} were skipped "
                f"({dict(report.skipped)})."
            )
        raise ValueError(f"{path} holds no record.")

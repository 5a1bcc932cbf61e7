"""Host-side checks of SFT and preference records before they enter a pipeline."""

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from tunelib.data._tokenizer import Tokenizer

RecordKind = Literal["sft", "preference"]
OnInvalid = Literal["raise", "skip"]

# The fields each kind needs; the ones after "prompt" are completions, which must be non-empty.
FIELDS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
}
# Why a record is invalid, in the order the checks run (a record counts under its first reason).
REASONS = ("not_a_dict", "missing_field", "not_a_string", "empty", "unknown_character", "too_long")


class RecordError(ValueError):
    """An invalid record: the message names the record index and the field.

    Attributes:
      index: position of the record in the input.
      field: the offending field, or None when the record is not a dict.
      reason: one of `REASONS` (or `HF_REASONS`), the key it is counted under when skipping.
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
    """What `validate_records` kept and skipped.

    Attributes:
      kept: number of valid records.
      skipped: number of invalid records per reason (a `collections.Counter`: a reason that
        did not occur reads as 0). Reasons: `"not_a_dict"`, `"missing_field"`,
        `"not_a_string"`, `"empty"`, `"unknown_character"`, `"too_long"`.
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


def _check_record(
    index: int, record: object, kind: str, tokenizer: Tokenizer, max_length: int
) -> None:
    """Raise a `RecordError` for the first problem of `record`, if any."""
    fields = FIELDS[kind]
    if not isinstance(record, Mapping):
        raise RecordError(
            index,
            None,
            "not_a_dict",
            f"expected a dict with fields {fields}, got {type(record).__name__}",
        )
    for field in fields:
        if field not in record:
            raise RecordError(index, field, "missing_field", f"field {field!r} is missing")
    for field in fields:
        if not isinstance(record[field], str):
            found = type(record[field]).__name__
            raise RecordError(
                index, field, "not_a_string", f"field {field!r} must be a str, got {found}"
            )
    for field in fields[1:]:
        if not record[field]:
            raise RecordError(index, field, "empty", f"field {field!r} is empty")
    lengths = {}
    for field in fields:
        try:
            lengths[field] = len(tokenizer.encode(record[field]))
        except ValueError as error:
            raise RecordError(
                index, field, "unknown_character", f"field {field!r}: {error}"
            ) from None
    for field in fields[1:]:
        total = 1 + lengths["prompt"] + lengths[field] + 1
        if total > max_length:
            raise RecordError(
                index,
                field,
                "too_long",
                f"field {field!r} makes the sequence BOS + prompt ({lengths['prompt']}) + "
                f"{field} ({lengths[field]}) + EOS {total} tokens long, more than "
                f"max_length={max_length}",
            )


def validate_records(
    records: Iterable[Any],
    *,
    kind: RecordKind,
    tokenizer: Tokenizer,
    max_length: int,
    on_invalid: OnInvalid = "raise",
) -> tuple[list[Mapping[str, Any]], RecordReport]:
    """Check SFT or preference records and raise on, or drop, the invalid ones.

    `kind="sft"` needs the string fields `"prompt"` and `"completion"`; `kind="preference"`
    needs `"prompt"`, `"chosen"` and `"rejected"`. Other fields are allowed and kept. A record
    is invalid, counted under the first reason that applies, when it

    * is not a dict (`"not_a_dict"`),
    * misses a field (`"missing_field"`),
    * has a field that is not a `str` (`"not_a_string"`),
    * has an empty completion, `chosen` or `rejected` (`"empty"`; an empty prompt is fine),
    * has text the tokenizer cannot encode (`"unknown_character"`),
    * or does not fit: BOS + prompt + completion + EOS, for each completion of a pair, is
      longer than `max_length` tokens (`"too_long"`).

    Args:
      records: the records, any iterable.
      kind: `"sft"` or `"preference"`.
      tokenizer: encodes the text (a `CharTokenizer` or any `Tokenizer`).
      max_length: the most tokens a full sequence, BOS and EOS included, may have.
      on_invalid: `"raise"` (the default) raises a `RecordError` for the first invalid record;
        `"skip"` drops invalid records and counts them in the report.

    Returns:
      `(kept, report)`: the valid records in input order (the same objects), and a
      `RecordReport` with `kept` and the per-reason `skipped` counts.

    Raises:
      RecordError: a `ValueError` whose message names the record index and the field, e.g.
        `"record 17: field 'chosen' is empty"`.

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
      record 1: field 'completion' is missing
    """
    if kind not in FIELDS:
        raise ValueError(f"kind must be 'sft' or 'preference', got {kind!r}.")
    check_on_invalid(on_invalid)
    check_max_length(max_length, at_least=3)
    kept = []
    skipped: collections.Counter[str] = collections.Counter()
    for index, record in enumerate(records):
        try:
            _check_record(index, record, kind, tokenizer, max_length)
        except RecordError as error:
            if on_invalid == "raise":
                raise
            skipped[error.reason] += 1
        else:
            kept.append(record)
    return kept, RecordReport(kept=len(kept), skipped=skipped)

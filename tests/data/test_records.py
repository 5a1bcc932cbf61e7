import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import own_checks, raises_naming
from tunelib.data import REASONS, CharTokenizer, RecordError, RecordReport, validate_records

tok = CharTokenizer()
SFT = {"prompt": "1+2=", "completion": "3"}
PAIR = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}

# (kind, invalid record, reason, field named in the message); max_length is 8 throughout.
INVALID = [
    ("sft", 7, "not_a_dict", None),
    ("sft", ["1+2=", "3"], "not_a_dict", None),
    ("sft", {"completion": "3"}, "missing_field", "prompt"),
    ("sft", {"prompt": "1+2="}, "missing_field", "completion"),
    ("sft", {"prompt": 12, "completion": "3"}, "not_a_string", "prompt"),
    ("sft", {"prompt": "1+2=", "completion": 3}, "not_a_string", "completion"),
    ("sft", {"prompt": "1+2=", "completion": None}, "not_a_string", "completion"),
    ("sft", {"prompt": "1+2=", "completion": ""}, "empty", "completion"),
    ("sft", {"prompt": "1#2=", "completion": "3"}, "unknown_character", "prompt"),
    ("sft", {"prompt": "1+2=", "completion": "3€"}, "unknown_character", "completion"),
    ("sft", {"prompt": "11+22=", "completion": "3"}, "too_long", "completion"),
    ("preference", "1+2=", "not_a_dict", None),
    ("preference", {"prompt": "1+2=", "chosen": "3"}, "missing_field", "rejected"),
    ("preference", {"prompt": "1+2=", "rejected": "4"}, "missing_field", "chosen"),
    ("preference", {**PAIR, "rejected": b"4"}, "not_a_string", "rejected"),
    ("preference", {**PAIR, "chosen": ""}, "empty", "chosen"),
    ("preference", {**PAIR, "rejected": ""}, "empty", "rejected"),
    ("preference", {**PAIR, "chosen": "3?#"}, "unknown_character", "chosen"),
    ("preference", {**PAIR, "rejected": "4444"}, "too_long", "rejected"),
    ("preference", {**PAIR, "chosen": "3333"}, "too_long", "chosen"),
]


def valid(kind):
    return [dict(SFT), dict(SFT, completion="33")] if kind == "sft" else [dict(PAIR), PAIR]


@pytest.mark.parametrize(("kind", "record", "reason", "field"), INVALID)
def test_each_reason_raises_and_is_counted(kind, record, reason, field):
    records = [*valid(kind), record, *valid(kind)]
    with raises_naming("record 2", *([f"'{field}'"] if field else []), error=RecordError) as info:
        validate_records(records, kind=kind, tokenizer=tok, max_length=8)
    assert isinstance(info.value, ValueError)
    assert (info.value.index, info.value.field, info.value.reason) == (2, field, reason)
    kept, report = validate_records(
        records, kind=kind, tokenizer=tok, max_length=8, on_invalid="skip"
    )
    assert kept == [*valid(kind), *valid(kind)]
    assert report == RecordReport(kept=4, skipped={reason: 1})
    assert report.num_skipped == 1
    assert all(report.skipped[other] == 0 for other in REASONS if other != reason)


def test_messages():
    records = [dict(PAIR)] * 17 + [{**PAIR, "chosen": ""}]
    with pytest.raises(RecordError, match=r"^record 17: field 'chosen' is empty$"):
        validate_records(records, kind="preference", tokenizer=tok, max_length=8)
    with raises_naming("record 0", "'#'", "position 1", error=RecordError):
        validate_records(
            [{"prompt": "1#", "completion": "3"}], kind="sft", tokenizer=tok, max_length=8
        )
    with raises_naming("record 0", "'completion'", "9 tokens", "max_length=8", error=RecordError):
        validate_records(
            [{"prompt": "11+22=", "completion": "3"}], kind="sft", tokenizer=tok, max_length=8
        )
    with raises_naming("record 0", "dict", "int", error=RecordError):
        validate_records([5], kind="sft", tokenizer=tok, max_length=8)


def test_length_boundary():
    # BOS + "12+3=" + "15" + EOS = 9 tokens.
    record = {"prompt": "12+3=", "completion": "15"}
    assert validate_records([record], kind="sft", tokenizer=tok, max_length=9)[0] == [record]
    with raises_naming("record 0", "'completion'", error=RecordError):
        validate_records([record], kind="sft", tokenizer=tok, max_length=8)
    # Each side of a pair must fit on its own: the longer side decides.
    pair = {"prompt": "12+3=", "chosen": "15", "rejected": "5"}
    assert validate_records([pair], kind="preference", tokenizer=tok, max_length=9)[1].kept == 1
    with raises_naming("'chosen'", error=RecordError):
        validate_records([pair], kind="preference", tokenizer=tok, max_length=8)


@given(st.lists(st.sampled_from([None, *range(len(INVALID))]), max_size=30))
def test_skip_counts_every_reason(choices):
    """A random mix of valid and invalid records: kept in order, counted per reason."""
    records, expected_kept, expected_skipped = [], [], {}
    for choice in choices:
        if choice is None:
            records.append({"prompt": f"{len(records)}=", "completion": "1"})
            expected_kept.append(records[-1])
        elif INVALID[choice][0] == "sft":
            _, record, reason, _ = INVALID[choice]
            records.append(record)
            expected_skipped[reason] = expected_skipped.get(reason, 0) + 1
    kept, report = validate_records(
        iter(records), kind="sft", tokenizer=tok, max_length=8, on_invalid="skip"
    )
    assert kept == expected_kept
    assert all(a is b for a, b in zip(kept, expected_kept, strict=True))
    assert report.kept == len(expected_kept)
    assert dict(report.skipped) == expected_skipped


def test_extra_fields_and_empty_prompt_are_fine():
    records = [{"prompt": "", "completion": "7", "answer": "7", "id": 3}, {**PAIR, "meta": [1]}]
    kept, report = validate_records(records[:1], kind="sft", tokenizer=tok, max_length=3)
    assert kept == records[:1] and report == RecordReport(kept=1, skipped={})
    kept, _ = validate_records(records[1:], kind="preference", tokenizer=tok, max_length=8)
    assert kept[0] is records[1]
    assert validate_records([], kind="sft", tokenizer=tok, max_length=8) == (
        [],
        RecordReport(0, {}),
    )


def test_argument_errors():
    with raises_naming("kind"):
        validate_records([SFT], kind="dpo", tokenizer=tok, max_length=8)
    with raises_naming("on_invalid"):
        validate_records([SFT], kind="sft", tokenizer=tok, max_length=8, on_invalid="drop")
    with raises_naming("tokenizer"):
        validate_records([SFT], kind="sft", tokenizer="chars", max_length=8)
    with own_checks():
        with raises_naming("kind", "'dpo'", error=ValueError):
            validate_records([SFT], kind="dpo", tokenizer=tok, max_length=8)
        with raises_naming("on_invalid", "'drop'", error=ValueError):
            validate_records([SFT], kind="sft", tokenizer=tok, max_length=8, on_invalid="drop")
    with raises_naming("max_length", "2", error=ValueError):
        validate_records([SFT], kind="sft", tokenizer=tok, max_length=2)

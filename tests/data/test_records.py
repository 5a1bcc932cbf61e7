"""Record checks, record files and the deprecated names of the Hugging Face record checks."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import own_checks, raises_naming
from tunelib.data import (
    REASONS,
    CharTokenizer,
    RecordError,
    RecordReport,
    read_records,
    validate_records,
)

tok = CharTokenizer()
SFT = {"prompt": "1+2=", "completion": "3"}
PAIR = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
RL = {"prompt": "1+2=", "answer": "3"}
VALID = {"sft": SFT, "preference": PAIR, "rl": RL}
USER = {"role": "user", "content": "what is 2 + 2?"}
ANSWER = {"role": "assistant", "content": "the answer is 4."}
WRONG = {"role": "assistant", "content": "5"}
SFT_CHAT = {"messages": [USER, ANSWER], "id": 0}
SFT_CHAT_PAIR = {"prompt": [USER], "completion": [ANSWER]}
PREFERENCE_CHAT = {"prompt": [USER], "chosen": [ANSWER], "rejected": [WRONG]}
RL_CHAT = {"prompt": [USER], "answer": "4"}

# (kind, invalid record, reason, field, words of the message). Shapes are checked without a
# tokenizer; the rows from `TOKENS` on with a `CharTokenizer` and max_length=8.
SHAPES = [
    ("sft", 7, "not_a_dict", None, "expected a dict, got int"),
    ("sft", ["1+2=", "3"], "not_a_dict", None, "list"),
    ("sft", {"completion": "3"}, "missing_field", "prompt", "'prompt' is missing"),
    ("sft", {"prompt": "1+2="}, "missing_field", "completion", "(or give 'messages')"),
    ("sft", {"prompt": "1+2=", "completion": None}, "missing_field", "completion", "missing"),
    ("sft", {"prompt": 12, "completion": "3"}, "wrong_type", "prompt", "string or a list"),
    ("sft", {"prompt": "1+2=", "completion": b"3"}, "wrong_type", "completion", "bytes"),
    ("sft", {"prompt": "1+2=", "completion": ""}, "empty", "completion", "'completion' is empty"),
    ("sft", {"messages": "hi"}, "wrong_type", "messages", "'messages' must be a string or a list"),
    ("sft", {"messages": []}, "empty", "messages", "empty conversation"),
    ("sft", {"messages": [USER, 5]}, "bad_message", "messages[1]", "messages[1] must be a dict"),
    (
        "sft",
        {"messages": [USER, {"role": "bot", "content": "x"}]},
        "bad_message",
        "messages[1].role",
        "'bot'",
    ),
    (
        "sft",
        {"messages": [USER, {"role": "assistant"}]},
        "bad_message",
        "messages[1].content",
        "NoneType",
    ),
    ("sft", {"messages": [USER]}, "no_assistant", "messages", "no assistant"),
    ("sft", {"prompt": [USER], "completion": "4"}, "mixed_formats", "completion", "mix strings"),
    ("preference", "1+2=", "not_a_dict", None, "str"),
    ("preference", {"prompt": "1+2=", "chosen": "3"}, "missing_field", "rejected", "missing"),
    ("preference", {"prompt": "1+2=", "rejected": "4"}, "missing_field", "chosen", "missing"),
    ("preference", {**PAIR, "rejected": 3}, "wrong_type", "rejected", "int"),
    ("preference", {**PAIR, "chosen": ""}, "empty", "chosen", "'chosen' is empty"),
    ("preference", {**PAIR, "rejected": ""}, "empty", "rejected", "'rejected' is empty"),
    ("preference", {**PREFERENCE_CHAT, "rejected": []}, "empty", "rejected", "empty conversation"),
    ("rl", {"prompt": "x", "answer": 4}, "not_a_string", "answer", "'answer' must be a str"),
    ("rl", {"prompt": "", "answer": "4"}, "empty", "prompt", "'prompt' is empty"),
    ("rl", {"answer": "4"}, "missing_field", "prompt", "'prompt' is missing"),
]
TOKENS = [
    ("sft", {"prompt": "1#2=", "completion": "3"}, "unknown_character", "prompt", "'#'"),
    ("sft", {"prompt": "1+2=", "completion": "3€"}, "unknown_character", "completion", "'€'"),
    ("sft", {"prompt": "11+22=", "completion": "3"}, "too_long", "completion", "9 tokens"),
    ("sft", SFT_CHAT, "template_error", "messages", "no chat template"),
    ("preference", {**PAIR, "chosen": "3?#"}, "unknown_character", "chosen", "position 2"),
    ("preference", {**PAIR, "rejected": "4444"}, "too_long", "rejected", "max_length=8"),
    ("preference", {**PAIR, "chosen": "3333"}, "too_long", "chosen", "max_length=8"),
    ("preference", PREFERENCE_CHAT, "template_error", "chosen", "no chat template"),
    ("rl", {"prompt": "1#", "answer": "1"}, "unknown_character", "prompt", "'#'"),
    ("rl", {"prompt": "12345678", "answer": "1"}, "too_long", "prompt", "9 tokens"),
    ("rl", RL_CHAT, "template_error", "prompt", "no chat template"),
]
INVALID = SHAPES + TOKENS


@pytest.mark.parametrize(("kind", "record", "reason", "field", "message"), INVALID)
def test_each_reason_raises_and_is_counted(kind, record, reason, field, message):
    good = VALID[kind]
    records = [good, dict(good), record, good]
    checks = (
        {"tokenizer": tok, "max_length": 8} if (kind, record) in [r[:2] for r in TOKENS] else {}
    )
    with raises_naming(
        "record 2", message, *([f"{field}"] if field else []), error=RecordError
    ) as info:
        validate_records(records, kind=kind, **checks)
    assert isinstance(info.value, ValueError) and info.value.reason in REASONS
    assert (info.value.index, info.value.field, info.value.reason) == (2, field, reason)
    kept, report = validate_records(records, kind=kind, on_invalid="skip", **checks)
    assert kept == [good, good, good] and kept[1] is records[1]
    assert report == RecordReport(kept=3, skipped={reason: 1}) and report.num_skipped == 1
    assert all(report.skipped[other] == 0 for other in REASONS if other != reason)


def test_messages_and_lengths():
    records = [dict(PAIR)] * 17 + [{**PAIR, "chosen": ""}]
    with pytest.raises(RecordError, match=r"^record 17: field 'chosen' is empty$"):
        validate_records(records, kind="preference", tokenizer=tok, max_length=8)
    with raises_naming(
        "record 0", "'completion'", "BOS + prompt (6) + completion (1) + EOS 9 tokens",
        "max_length=8", error=RecordError,
    ):  # fmt: skip
        validate_records(
            [{"prompt": "11+22=", "completion": "3"}], kind="sft", tokenizer=tok, max_length=8
        )
    # BOS + "12+3=" + "15" + EOS = 9 tokens; each side of a pair must fit on its own.
    record = {"prompt": "12+3=", "completion": "15"}
    assert validate_records([record], kind="sft", tokenizer=tok, max_length=9)[0] == [record]
    with raises_naming("record 0", "'completion'", error=RecordError):
        validate_records([record], kind="sft", tokenizer=tok, max_length=8)
    pair = {"prompt": "12+3=", "chosen": "15", "rejected": "5"}
    assert validate_records([pair], kind="preference", tokenizer=tok, max_length=9)[1].kept == 1
    with raises_naming("'chosen'", error=RecordError):
        validate_records([pair], kind="preference", tokenizer=tok, max_length=8)
    # Without max_length only the text is checked; an empty prompt is fine.
    long = {"prompt": "", "completion": "1" * 50, "id": 3}
    assert validate_records([long], kind="sft", tokenizer=tok) == ([long], RecordReport(1, {}))
    assert validate_records([], kind="sft") == ([], RecordReport(0, {}))


@given(st.lists(st.sampled_from([None, *range(len(SHAPES))]), max_size=30))
def test_skip_counts_every_reason(choices):
    """A random mix of valid and invalid records: kept in order, counted per reason."""
    records, expected_kept, expected_skipped = [], [], {}
    for choice in choices:
        if choice is None:
            records.append({"prompt": f"{len(records)}=", "completion": "1"})
            expected_kept.append(records[-1])
        elif SHAPES[choice][0] == "sft":
            _, record, reason, _, _ = SHAPES[choice]
            records.append(record)
            expected_skipped[reason] = expected_skipped.get(reason, 0) + 1
    kept, report = validate_records(iter(records), kind="sft", on_invalid="skip")
    assert all(a is b for a, b in zip(kept, expected_kept, strict=True))
    assert len(kept) == report.kept == len(expected_kept)
    assert dict(report.skipped) == expected_skipped


def test_argument_errors():
    with raises_naming("kind"):
        validate_records([SFT], kind="dpo")
    with raises_naming("on_invalid"):
        validate_records([SFT], kind="sft", on_invalid="drop")
    with raises_naming("tokenizer"):
        validate_records([SFT], kind="sft", tokenizer="chars", max_length=8)
    with own_checks():
        with raises_naming("kind", "'dpo'", "'rl'", error=ValueError):
            validate_records([SFT], kind="dpo")
        with raises_naming("on_invalid", "'drop'", error=ValueError):
            validate_records([SFT], kind="sft", on_invalid="drop")
    with raises_naming("max_length", "1", error=ValueError):
        validate_records([SFT], kind="sft", tokenizer=tok, max_length=1)
    with raises_naming("max_length", "tokenizer", error=ValueError):
        validate_records([SFT], kind="sft", max_length=8)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("kind", "records"),
    [
        ("sft", [SFT_CHAT, SFT, SFT_CHAT_PAIR]),
        ("preference", [PAIR, PREFERENCE_CHAT]),
        ("rl", [RL, RL_CHAT]),
    ],
)
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_reads_each_shape_from_each_format(tmp_path, kind, records, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, records)
    elif suffix == ".json":
        path.write_text(json.dumps(records))
    else:  # one Parquet file per shape: its columns are the union of the records' fields
        for i, record in enumerate(records):
            pq.write_table(pa.Table.from_pylist([record] * 3), tmp_path / f"{i}.parquet")
        path = tmp_path / "0.parquet"
        records = [records[0]] * 3
    got, report = read_records(path, kind=kind)
    assert report.kept == len(records) and report.num_skipped == 0
    assert [{k: v for k, v in r.items() if v is not None} for r in got] == records


def test_parquet_nulls_and_row_groups(tmp_path):
    rows = [SFT, {"prompt": "x", "completion": None}, SFT] * 5
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    with raises_naming("record 1", "'completion'", "missing", error=RecordError):
        read_records(path, kind="sft")
    got, report = read_records(path, kind="sft", on_invalid="skip")
    assert len(got) == 10 and dict(report.skipped) == {"missing_field": 5}


def test_file_errors_name_the_record_the_line_or_the_file(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [SFT_CHAT, SFT_CHAT, {"messages": [USER]}])
    with raises_naming("record 2", "no assistant", error=RecordError) as info:
        read_records(path, kind="sft")
    assert (info.value.field, info.value.reason) == ("messages", "no_assistant")
    path.write_text(json.dumps(RL) + "\n\n" + '{"prompt": "x", \n' + json.dumps(RL) + "\n")
    with raises_naming("record 1", "line 3", "not JSON", error=RecordError):
        read_records(path, kind="rl")
    kept, report = read_records(path, kind="rl", on_invalid="skip")
    assert kept == [RL, RL] and dict(report.skipped) == {"bad_json": 1}
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with raises_naming(".parquet", "data.csv", error=ValueError):
        read_records(tmp_path / "data.csv", kind="rl")
    with raises_naming("no data file", error=FileNotFoundError):
        read_records(tmp_path / "missing.jsonl", kind="rl")
    (tmp_path / "array.json").write_text("[1, 2")
    with raises_naming("array.json", "not a JSON array", error=ValueError):
        read_records(tmp_path / "array.json", kind="rl")


@pytest.mark.parametrize("content", ["", "\n\n", "[]"])
def test_a_file_with_no_record_is_one_clear_error(tmp_path, content):
    path = tmp_path / "empty.json"
    path.write_text(content)
    with raises_naming(str(path), "no record", error=ValueError):
        read_records(path, kind="sft", on_invalid="skip")
    pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("prompt", pa.string())])),
                   tmp_path / "empty.parquet")  # fmt: skip
    with raises_naming("empty.parquet", "no record", error=ValueError):
        read_records(tmp_path / "empty.parquet", kind="rl")


def test_a_file_with_no_valid_record_is_one_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}, 3])
    with raises_naming(str(path), "no valid rl record", "2", "missing_field", error=ValueError):
        read_records(path, kind="rl", on_invalid="skip")


def test_deprecated_names_of_the_hugging_face_checks():
    import tunelib.data

    records = [SFT_CHAT, {"messages": [USER]}, RL]
    with pytest.warns(DeprecationWarning, match="validate_hf_records.*validate_records"):
        validate_hf_records = tunelib.data.validate_hf_records
    old = validate_hf_records(records, kind="sft", on_invalid="skip")
    assert old == validate_records(records, kind="sft", on_invalid="skip")
    with pytest.warns(DeprecationWarning, match="HF_REASONS.*REASONS"):
        hf_reasons = tunelib.data.HF_REASONS
    old_reasons = ("bad_json", "not_a_dict", "missing_field", "wrong_type", "bad_message", "empty",
                   "no_assistant", "mixed_formats", "template_error", "too_long")  # fmt: skip
    assert hf_reasons is REASONS and set(old_reasons) <= set(REASONS)
    assert "HF_REASONS" not in tunelib.data.__all__

"""Hugging Face-shaped records from JSON lines and Parquet, and the pipelines that tokenize them."""

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests._helpers import raises_naming
from tests._hf import PLAIN_CHAT_TEMPLATE, write_chat_jsonl, write_tokenizer
from tunelib.data import (
    HFTokenizer,
    RecordError,
    encode_chat,
    encode_hf_records,
    hf_preference_dataset,
    hf_prompts,
    hf_sft_dataset,
    read_records,
    validate_hf_records,
)

USER = {"role": "user", "content": "what is 2 + 2?"}
ANSWER = {"role": "assistant", "content": "the answer is 4."}
WRONG = {"role": "assistant", "content": "5"}
SFT_CHAT = {"messages": [USER, ANSWER], "id": 0}
SFT_TEXT = {"prompt": "what is 2 + 2? ", "completion": "4"}
SFT_CHAT_PAIR = {"prompt": [USER], "completion": [ANSWER]}
PREFERENCE_TEXT = {"prompt": "2 + 2 = ", "chosen": "4", "rejected": "5"}
PREFERENCE_CHAT = {"prompt": [USER], "chosen": [ANSWER], "rejected": [WRONG]}
RL = {"prompt": "what is 2 + 2?", "answer": "4"}
RL_CHAT = {"prompt": [USER], "answer": "4"}
KEYS = ("tokens", "targets", "where", "attention_where")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return HFTokenizer.from_directory(write_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory):
    return HFTokenizer.from_directory(write_tokenizer(tmp_path_factory.mktemp("bos"), add_bos=True))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("kind", "records"),
    [
        ("sft", [SFT_CHAT, SFT_TEXT, SFT_CHAT_PAIR]),
        ("preference", [PREFERENCE_TEXT, PREFERENCE_CHAT]),
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
    rows = [SFT_TEXT, {"prompt": "x", "completion": None}, SFT_TEXT] * 5
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    with raises_naming("record 1", "'completion'", "missing", error=RecordError):
        read_records(path, kind="sft")
    got, report = read_records(path, kind="sft", on_invalid="skip")
    assert len(got) == 10 and dict(report.skipped) == {"missing_field": 5}


BAD = [
    ("sft", 7, None, "not_a_dict", "expected a dict"),
    ("sft", {"messages": "hi"}, "messages", "wrong_type", "'messages' must be a string or a list"),
    ("sft", {"messages": []}, "messages", "empty", "empty conversation"),
    ("sft", {"messages": [USER, 5]}, "messages[1]", "bad_message", "messages[1] must be a dict"),
    (
        "sft",
        {"messages": [USER, {"role": "bot", "content": "x"}]},
        "messages[1].role",
        "bad_message",
        "'bot'",
    ),
    (
        "sft",
        {"messages": [USER, {"role": "assistant"}]},
        "messages[1].content",
        "bad_message",
        "NoneType",
    ),
    ("sft", {"messages": [USER]}, "messages", "no_assistant", "no assistant"),
    ("sft", {"prompt": "x"}, "completion", "missing_field", "(or give 'messages')"),
    ("sft", {"prompt": "x", "completion": ""}, "completion", "empty", "'completion' is empty"),
    ("sft", {"prompt": [USER], "completion": "4"}, "completion", "mixed_formats", "mix strings"),
    (
        "preference",
        {"prompt": "x", "chosen": "a"},
        "rejected",
        "missing_field",
        "'rejected' is missing",
    ),
    ("preference", {"prompt": "x", "chosen": "a", "rejected": 3}, "rejected", "wrong_type", "int"),
    ("preference", {**PREFERENCE_CHAT, "rejected": []}, "rejected", "empty", "empty conversation"),
    ("rl", {"prompt": "x", "answer": 4}, "answer", "wrong_type", "'answer' must be a str"),
    ("rl", {"prompt": "", "answer": "4"}, "prompt", "empty", "'prompt' is empty"),
    ("rl", {"answer": "4"}, "prompt", "missing_field", "'prompt' is missing"),
]


@pytest.mark.parametrize(("kind", "record", "field", "reason", "message"), BAD)
def test_bad_records_name_the_record_and_field(tmp_path, kind, record, field, reason, message):
    good = {"sft": SFT_CHAT, "preference": PREFERENCE_TEXT, "rl": RL}[kind]
    path = write_jsonl(tmp_path / "data.jsonl", [good, good, record, good])
    with raises_naming("record 2", message, error=RecordError) as info:
        read_records(path, kind=kind)
    assert (info.value.index, info.value.field, info.value.reason) == (2, field, reason)
    kept, report = read_records(path, kind=kind, on_invalid="skip")
    assert len(kept) == 3 and dict(report.skipped) == {reason: 1}


def test_bad_json_lines_are_named_by_line(tmp_path):
    path = tmp_path / "data.jsonl"
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
    with raises_naming("kind"):
        validate_hf_records([RL], kind="dpo")


def ref_row(ids, where, max_length, pad_id):
    """The next-token layout from its definition, position by position."""
    row = {key: [] for key in KEYS}
    for t in range(max_length):
        real = t + 1 < len(ids)
        row["tokens"].append(ids[t] if real else pad_id)
        row["targets"].append(ids[t + 1] if real else pad_id)
        row["where"].append(bool(real and where[t + 1]))
        row["attention_where"].append(real)
    return {
        k: np.asarray(v, np.int32 if k in ("tokens", "targets") else np.bool_)
        for k, v in row.items()
    }


def assert_row(batch, row, expected):
    for key in KEYS:
        assert batch[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(batch[key][row], expected[key], err_msg=key)


def test_sft_batches_of_chat_text_and_prompt_completion(tok, bos_tok):
    records = [SFT_CHAT, SFT_TEXT, SFT_CHAT_PAIR]
    batch = next(iter(hf_sft_dataset(records, tok, max_length=96, batch_size=3, shuffle=False)))
    assert {k: v.shape for k, v in batch.items()} == {k: (3, 96) for k in KEYS}
    ids, where = encode_chat(tok, SFT_CHAT["messages"])
    assert_row(batch, 0, ref_row(ids, where, 96, tok.pad_id))
    # The chat pair trains on the same tokens as the conversation it is a split of (the
    # template's generation blocks mark the answer either way).
    pair_ids, pair_where = encode_chat(tok, [USER, ANSWER], prompt_length=1)
    np.testing.assert_array_equal(pair_ids, ids)
    np.testing.assert_array_equal(pair_where, where)
    assert_row(batch, 2, ref_row(ids, where, 96, tok.pad_id))
    # Strings: prompt then completion tokenized separately, EOS the last target, no BOS here.
    prompt, completion = tok.encode(SFT_TEXT["prompt"]), tok.encode(SFT_TEXT["completion"])
    text_ids = [*prompt, *completion, tok.eos_id]
    text_where = [False] * len(prompt) + [True] * (len(completion) + 1)
    assert_row(batch, 1, ref_row(text_ids, text_where, 96, tok.pad_id))
    # The chat targets are exactly the assistant answer and its end of turn.
    targets = batch["targets"][0][batch["where"][0]]
    assert tok.decode(targets, stop_at_eos=False) == ANSWER["content"]
    assert targets[-1] == tok.eos_id  # <|im_end|>
    # A tokenizer whose post-processor adds BOS starts string sequences with it.
    bos_batch = next(iter(hf_sft_dataset([SFT_TEXT], bos_tok, max_length=32, batch_size=1)))
    assert bos_batch["tokens"][0, 0] == bos_tok.bos_id
    assert_row(bos_batch, 0, ref_row([bos_tok.bos_id, *text_ids], [False, *text_where], 32, 0))


def test_masks_from_a_template_without_generation_blocks(tmp_path, tok):
    directory = write_tokenizer(tmp_path / "plain", chat_template=PLAIN_CHAT_TEMPLATE)
    plain = HFTokenizer.from_directory(directory)
    (batch,) = hf_sft_dataset([SFT_CHAT, SFT_CHAT_PAIR], plain, max_length=96, batch_size=2,
                              num_epochs=1, shuffle=False)  # fmt: skip
    for row in range(2):  # the turn, its end and the blank line before the next turn
        targets = batch["targets"][row][batch["where"][row]]
        assert tok.decode(targets, stop_at_eos=False) == ANSWER["content"] + "\n\n"
        assert tok.eos_id in targets.tolist()


def test_preference_batches(tok):
    ds = hf_preference_dataset([PREFERENCE_TEXT, PREFERENCE_CHAT], tok, max_length=80, batch_size=2,
                               shuffle=False)  # fmt: skip
    batch = next(iter(ds))
    for side, response in (("chosen", ANSWER), ("rejected", WRONG)):
        ids, where = encode_chat(tok, [USER, response], prompt_length=1)
        assert_row(batch[side], 1, ref_row(ids, where, 80, tok.pad_id))
        targets = batch[side]["targets"][1][batch[side]["where"][1]]
        assert tok.decode(targets, stop_at_eos=False) == response["content"]
    n_prompt = len(tok.encode(PREFERENCE_TEXT["prompt"]))
    chosen = batch["chosen"]
    assert chosen["where"][0].sum() == len(tok.encode("4")) + 1
    assert not chosen["where"][0, : n_prompt - 1].any() and chosen["where"][0, n_prompt - 1]
    np.testing.assert_array_equal(
        chosen["tokens"][0, :n_prompt], batch["rejected"]["tokens"][0, :n_prompt]
    )


def test_too_long_and_template_errors_raise_or_skip(tok, caplog):
    long = {"messages": [USER, {"role": "assistant", "content": "the quick brown fox " * 10}]}
    with raises_naming("record 1", "'messages'", "max_length=40", error=RecordError) as info:
        encode_hf_records([SFT_CHAT, long], tok, kind="sft", max_length=40)
    assert info.value.reason == "too_long"
    no_template = HFTokenizer(tok.tokenizer, eos_token="<|im_end|>")
    with raises_naming("record 0", "no chat template", error=RecordError):
        encode_hf_records([PREFERENCE_CHAT], no_template, kind="preference", max_length=40)
    records = [SFT_CHAT, long, 3, SFT_TEXT]
    examples, report = encode_hf_records(records, tok, kind="sft", max_length=40, on_invalid="skip")
    assert len(examples) == 2 and dict(report.skipped) == {"too_long": 1, "not_a_dict": 1}
    with caplog.at_level("WARNING"):
        ds = hf_sft_dataset([SFT_CHAT, long], tok, max_length=40, batch_size=1, on_invalid="skip")
    assert "skipped 1 invalid records" in caplog.text and "too_long" in caplog.text
    assert len(list(itertools.islice(ds, 3))) == 3
    with raises_naming("no valid sft record", error=ValueError):
        hf_sft_dataset([long], tok, max_length=40, batch_size=1, on_invalid="skip")


def test_iterator_state_resumes_the_same_stream(tmp_path, tok):
    records, _ = read_records(write_chat_jsonl(tmp_path / "chat.jsonl", 10), kind="sft")
    ds = hf_sft_dataset(records, tok, max_length=80, batch_size=3, seed=7)
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = iter(ds)
    resumed.set_state(json.loads(json.dumps(state)))
    for want in expected:
        got = next(resumed)
        for key in KEYS:
            np.testing.assert_array_equal(got[key], want[key])


def test_prompts_for_sampling(tok, bos_tok):
    tokens, where = hf_prompts(["2 + 2 =", [USER]], bos_tok, max_length=48)
    first = [bos_tok.bos_id, *bos_tok.encode("2 + 2 =")]
    assert tokens[0, -len(first) :].tolist() == first and where[0].sum() == len(first)
    chat, _ = encode_chat(bos_tok, [USER], add_generation_prompt=True)
    assert tokens[1, -len(chat) :].tolist() == chat.tolist() and where[1].sum() == len(chat)
    assert tok.decode(tokens[1][where[1]], stop_at_eos=False).endswith("assistant\n")
    with raises_naming("prompts[1]", "max_length=10", error=ValueError):
        hf_prompts(["2", [USER]], tok, max_length=10)
    with raises_naming("prompts[0]", "role", error=ValueError):
        hf_prompts([[{"role": "bot", "content": "x"}]], tok, max_length=10)
    with raises_naming("prompts[0]", "no token", error=ValueError):
        hf_prompts([""], tok, max_length=10)

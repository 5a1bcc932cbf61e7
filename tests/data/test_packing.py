"""Packed batches: each sequence as in a padded batch, segment ids, positions, resume, fill."""

import json

import numpy as np
import pytest

from tests._helpers import raises_naming
from tests._hf import CHAT_TEMPLATE
from tunelib.data import (
    CharTokenizer,
    HFTokenizer,
    RecordError,
    arithmetic_split,
    preference_dataset,
    preference_pairs,
    sft_dataset,
)

tok = CharTokenizer()
KEYS = ("tokens", "targets", "where", "attention_where")
PACKED = {
    "tokens": np.int32,
    "targets": np.int32,
    "where": np.bool_,
    "attention_where": np.bool_,
    "segment_ids": np.int32,
    "positions": np.int32,
}


def skewed_records(n: int, *, seed: int = 0, longest: int = 40) -> list[dict[str, str]]:
    """Prompt-completion records of skewed lengths (most short, a few long), all distinct."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij"))
    records = []
    for i in range(n):
        size = int(min(longest, 1 + rng.lognormal(1.5, 0.9)))
        prompt = f"{i}:" + "".join(rng.choice(letters, size))
        records.append({"prompt": prompt, "completion": "".join(rng.choice(letters, 1 + i % 3))})
    return records


def unpack(batches, max_segments):
    """Every sequence of packed batches, as `{key: [n] array}`, checking the packed layout."""
    sequences = []
    for batch in batches:
        assert {k: v.dtype for k, v in batch.items()} == PACKED
        for row in range(batch["tokens"].shape[0]):
            arrays = {k: v[row] for k, v in batch.items()}
            ids, positions = arrays["segment_ids"], arrays["positions"]
            count = ids.max()
            assert 1 <= count <= max_segments
            # Segments 1..count in order, each contiguous, then padding.
            starts = [int(np.argmax(ids == s)) for s in range(1, count + 1)]
            lengths = [int((ids == s).sum()) for s in range(1, count + 1)]
            expected_ids = np.concatenate(
                [np.full(n, s, np.int32) for s, n in enumerate(lengths, 1)]
                + [np.zeros(len(ids) - sum(lengths), np.int32)]
            )
            np.testing.assert_array_equal(ids, expected_ids)
            assert starts == list(np.cumsum([0, *lengths[:-1]]))
            pad = ids == 0
            assert not arrays["where"][pad].any() and not arrays["attention_where"][pad].any()
            assert (positions[pad] == 0).all() and (arrays["attention_where"] == ~pad).all()
            assert len(set(arrays["tokens"][pad]) | set(arrays["targets"][pad])) <= 1
            for start, n in zip(starts, lengths, strict=True):
                segment = {k: v[start : start + n] for k, v in arrays.items()}
                np.testing.assert_array_equal(segment["positions"], np.arange(n))
                # No target crosses a boundary: inside a segment the target is the next input.
                np.testing.assert_array_equal(segment["targets"][:-1], segment["tokens"][1:])
                sequences.append(segment)
    return sequences


def padded_rows(batch):
    """`{tokens of the real inputs: row}` of a padded batch, to find a sequence's record."""
    rows = {}
    for row in range(batch["tokens"].shape[0]):
        n = int(batch["attention_where"][row].sum())
        rows[tuple(batch["tokens"][row, :n])] = {k: batch[k][row, :n] for k in KEYS}
    return rows


def check_against_padded(sequences, padded):
    assert len(sequences) == len(padded)
    for segment in sequences:
        want = padded[tuple(segment["tokens"])]
        for key in KEYS:
            np.testing.assert_array_equal(segment[key], want[key], err_msg=key)


@pytest.mark.parametrize("which", ["char", "hf_eos_pads"])
def test_each_packed_sequence_equals_its_padded_row(which, hf_tok):
    if which == "char":
        tokenizer, records, max_length = tok, skewed_records(60), 48
    else:  # conversations and strings; EOS pads, so padding is not 0 here
        tokenizer = HFTokenizer(
            hf_tok.tokenizer, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
        )
        assert tokenizer.pad_id == tokenizer.eos_id == 3
        user = [{"role": "user", "content": "what is 2 + 2?"}]
        records = [
            {"prompt": f"question {i}: ", "completion": "the answer is " + "4" * (1 + i % 5)}
            if i % 2
            else {"messages": [*user, {"role": "assistant", "content": f"{i} " * (1 + i % 7)}]}
            for i in range(16)
        ]
        max_length = 96
    args = dict(max_length=max_length, shuffle=False, num_epochs=1, drop_remainder=False)
    padded = padded_rows(
        next(iter(sft_dataset(records, tokenizer, batch_size=len(records), **args)))
    )
    batches = list(
        sft_dataset(records, tokenizer, batch_size=4, packing=True, max_segments=6, **args)
    )
    assert all(b["tokens"].shape == (4, max_length) for b in batches[:-1])
    sequences = unpack(batches, max_segments=6)
    check_against_padded(sequences, padded)
    if which == "char":  # each sequence ends with EOS
        assert all(s["targets"][-1] == tokenizer.eos_id for s in sequences)
    pad = batches[0]["segment_ids"] == 0
    assert (batches[0]["tokens"][pad] == tokenizer.pad_id).all()
    assert (batches[0]["targets"][pad] == tokenizer.pad_id).all()
    # Packing saves rows.
    assert len(sequences) == len(records) and sum(len(b["tokens"]) for b in batches) < len(records)


def test_packed_pairs_are_consecutive_segments():
    train, _ = arithmetic_split(num_train=30, num_heldout=0, seed=2, max_digits=3, operations="+*")
    pairs = preference_pairs(train, seed=0)
    args = dict(max_length=40, shuffle=False, num_epochs=1, drop_remainder=False)
    padded = next(iter(preference_dataset(pairs, tok, batch_size=len(pairs), **args)))
    chosen, rejected = padded_rows(padded["chosen"]), padded_rows(padded["rejected"])
    batches = list(
        preference_dataset(pairs, tok, batch_size=3, packing=True, max_segments=4, **args)
    )
    assert all(set(b) == set(PACKED) for b in batches)  # one dict: no chosen / rejected sides
    sequences = unpack(batches, max_segments=4)
    check_against_padded(sequences[0::2], chosen)  # odd segment ids: chosen
    check_against_padded(sequences[1::2], rejected)  # even: the rejected side of the same pair
    for c, r in zip(sequences[0::2], sequences[1::2], strict=True):
        prompt = tok.decode(c["tokens"]).split("=")[0]
        assert tok.decode(r["tokens"]).split("=")[0] == prompt
    # What a consumer does: per-segment sums [B, S], split 0::2 / 1::2.
    for batch in batches:
        sums = np.zeros((batch["where"].shape[0], 4 + 1), np.int64)
        np.add.at(sums, (np.arange(len(sums))[:, None], batch["segment_ids"]), batch["where"])
        sums = sums[:, 1:]
        for row in range(len(sums)):
            count = batch["segment_ids"][row].max()
            assert count % 2 == 0 and (sums[row, count:] == 0).all()
            assert (sums[row, 0:count:2] > 0).all() and (sums[row, 1:count:2] > 0).all()


def test_max_segments_bounds_every_row():
    records = [{"prompt": "", "completion": "1"}] * 40  # 2 columns each: 12 would fit a row
    batches = list(sft_dataset(records, tok, max_length=24, batch_size=2, num_epochs=1,
                               packing=True, max_segments=3))  # fmt: skip
    assert len(batches) == 7 and all(
        (b["segment_ids"].max(axis=1) == 3).all() for b in batches[:-1]
    )
    assert sum(int(b["segment_ids"].max(axis=1).sum()) for b in batches) == 40


def test_deterministic_and_resumes_the_same_stream():
    # Grain shuffles a small dataset slowly (milliseconds per element): 100 records, not 20.
    records = skewed_records(100, seed=1)
    ds = sft_dataset(
        records, tok, max_length=48, batch_size=3, seed=5, packing=True, max_segments=5
    )
    it = iter(ds)
    stream = [next(it) for _ in range(12)]  # about 10 batches an epoch: this crosses into epoch 2
    assert sum(int(b["segment_ids"].max(axis=1).sum()) for b in stream) > len(records)
    for consumed in (2, 9):
        it = iter(ds)
        for _ in range(consumed):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        resumed = iter(ds)
        resumed.set_state(state)
        for want in stream[consumed : consumed + 3]:
            got = next(resumed)
            assert all((got[k] == want[k]).all() for k in PACKED)
    other = sft_dataset(records, tok, max_length=48, batch_size=3, seed=6, packing=True,
                        max_segments=5)  # fmt: skip
    first = next(iter(other))
    assert not all((first[k] == stream[0][k]).all() for k in PACKED)


def test_length_skewed_data_fills_rows():
    """The fill ratio quoted in `docs/data.md`: real tokens / all tokens of an epoch."""
    records = skewed_records(200, seed=3, longest=120)
    args = dict(max_length=128, batch_size=8, shuffle=False, num_epochs=1, drop_remainder=False)
    packed = list(sft_dataset(records, tok, packing=True, max_segments=16, **args))
    real = sum(int(b["attention_where"].sum()) for b in packed)
    assert real == sum(len(r["prompt"]) + len(r["completion"]) + 1 for r in records)
    padded_fill = real / (len(records) * 128)  # a padded batch holds one record per row
    packed_fill = real / sum(b["attention_where"].size for b in packed)
    assert padded_fill < 0.15 and packed_fill > 0.9, (padded_fill, packed_fill)
    assert len(packed) == 3 and len(records) / 8 == 25


def test_packing_argument_errors():
    records = skewed_records(4)
    with raises_naming("max_segments", "packing=True", error=ValueError):
        sft_dataset(records, tok, max_length=48, batch_size=1, packing=True)
    with raises_naming("max_segments=4", "packing=True", error=ValueError):
        sft_dataset(records, tok, max_length=48, batch_size=1, max_segments=4)
    with raises_naming("max_segments", "0", error=ValueError):
        sft_dataset(records, tok, max_length=48, batch_size=1, packing=True, max_segments=0)
    pair = {"prompt": "12+7=", "chosen": "19", "rejected": "20"}
    with raises_naming("max_segments", "even", "3", error=ValueError):
        preference_dataset([pair], tok, max_length=16, batch_size=1, packing=True, max_segments=3)
    # Each side fits 9 tokens, but the pair takes 8 + 8 columns of a row: too long packed only.
    assert next(iter(preference_dataset([pair], tok, max_length=9, batch_size=1)))
    with raises_naming("record 0", "8 + 8", "max_length=9", error=RecordError) as info:
        preference_dataset([pair], tok, max_length=9, batch_size=1, packing=True, max_segments=2)
    assert info.value.reason == "too_long"
    with raises_naming("no valid preference record", error=ValueError):
        preference_dataset([pair], tok, max_length=9, batch_size=1, packing=True, max_segments=2,
                           on_invalid="skip")  # fmt: skip

"""The pipelines: padded batches from any tokenizer, epochs, checkpoints, prompts for sampling,
and the deprecated names of the Hugging Face pipelines."""

import itertools
import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._helpers import own_checks, raises_naming
from tests._hf import PLAIN_CHAT_TEMPLATE, write_tokenizer
from tunelib.data import (
    CharTokenizer,
    HFTokenizer,
    RecordError,
    arithmetic_split,
    encode_chat,
    encode_prompts,
    encode_records,
    preference_dataset,
    preference_pairs,
    sft_dataset,
)

tok = CharTokenizer()
PAD, BOS, EOS = 0, 1, 2
KEYS = ("tokens", "targets", "where", "attention_where")
USER = {"role": "user", "content": "what is 2 + 2?"}
ANSWER = {"role": "assistant", "content": "the answer is 4."}
WRONG = {"role": "assistant", "content": "5"}
SFT_CHAT = {"messages": [USER, ANSWER], "id": 0}
SFT_TEXT = {"prompt": "what is 2 + 2? ", "completion": "4"}
SFT_CHAT_PAIR = {"prompt": [USER], "completion": [ANSWER]}
PREFERENCE_TEXT = {"prompt": "2 + 2 = ", "chosen": "4", "rejected": "5"}
PREFERENCE_CHAT = {"prompt": [USER], "chosen": [ANSWER], "rejected": [WRONG]}


def sft_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    train, _ = arithmetic_split(num_train=n, num_heldout=0, seed=seed)
    return [
        {"prompt": p["prompt"], "completion": p["answer"], "id": i} for i, p in enumerate(train)
    ]


def ref_ids_row(ids, where, max_length, pad_id):
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


def ref_row(prompt: str, completion: str, max_length: int) -> dict[str, np.ndarray]:
    """The layout of a `CharTokenizer` record: BOS, prompt, completion, EOS."""
    ids = [BOS, *tok.encode(prompt), *tok.encode(completion), EOS]
    where = [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)
    return ref_ids_row(ids, where, max_length, PAD)


def assert_batch_equal(batch, expected):
    assert set(batch) == set(expected)
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_batch_equal(batch[key], value)
        else:
            assert batch[key].dtype == value.dtype, key
            np.testing.assert_array_equal(batch[key], value, err_msg=key)


def test_hand_built_batch():
    records = [{"prompt": "12+7=", "completion": "19"}, {"prompt": "3-4=", "completion": "-1"}]
    ds = sft_dataset(records, tok, max_length=10, batch_size=2, shuffle=False, num_epochs=1)
    (batch,) = list(ds)
    # "1" -> 4, "2" -> 5, "+" -> 13, "7" -> 10, "=" -> 16, "9" -> 12, "3" -> 6, "-" -> 14
    expected = {
        "tokens": np.array(
            [[BOS, 4, 5, 13, 10, 16, 4, 12, PAD, PAD], [BOS, 6, 14, 7, 16, 14, 4, PAD, PAD, PAD]],
            np.int32,
        ),
        "targets": np.array(
            [[4, 5, 13, 10, 16, 4, 12, EOS, PAD, PAD], [6, 14, 7, 16, 14, 4, EOS, PAD, PAD, PAD]],
            np.int32,
        ),
        "where": np.array(
            [[0, 0, 0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]], np.bool_
        ),
        "attention_where": np.array(
            [[1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]], np.bool_
        ),
    }
    assert_batch_equal(batch, expected)


short_text = st.text(alphabet="0123456789+-*= ab", max_size=5)


# Each example builds a pipeline: fewer examples than the profile's, more records in each.
@settings(max_examples=10)
@given(st.lists(st.tuples(short_text, short_text.filter(bool)), min_size=1, max_size=15))
def test_layout_matches_reference(pairs):
    max_length = 12
    records = [{"prompt": p, "completion": c} for p, c in pairs]
    ds = sft_dataset(
        records, tok, max_length=max_length, batch_size=len(records), shuffle=False, num_epochs=1
    )
    (batch,) = list(ds)
    for i, (prompt, completion) in enumerate(pairs):
        assert_batch_equal(
            {k: v[i] for k, v in batch.items()}, ref_row(prompt, completion, max_length)
        )
        # The mask covers exactly the completion and the EOS target.
        where = batch["where"][i]
        assert tok.decode(batch["targets"][i][where], stop_at_eos=False) == completion
        assert batch["targets"][i][where][-1] == EOS and where.sum() == len(completion) + 1
        assert tok.decode(batch["tokens"][i][batch["attention_where"][i]]) == prompt + completion


def test_preference_batch_keeps_pairs_on_one_row():
    train, _ = arithmetic_split(num_train=40, num_heldout=0, seed=3)
    pairs = preference_pairs(train, seed=0)
    ds = preference_dataset(pairs, tok, max_length=12, batch_size=8, seed=5, num_epochs=1)
    batches = list(ds)
    assert len(batches) == 5
    seen = []
    for batch in batches:
        assert set(batch) == {"chosen", "rejected"}
        for side in batch.values():
            assert set(side) == set(KEYS)
            assert all(side[k].shape == (8, 12) for k in KEYS)
        for row in range(8):
            prompt = tok.decode(batch["chosen"]["tokens"][row]).split("=")[0] + "="
            pair = next(p for p in pairs if p["prompt"] == prompt)
            seen.append(prompt)
            for side in ("chosen", "rejected"):
                arrays = {k: v[row] for k, v in batch[side].items()}
                assert_batch_equal(arrays, ref_row(prompt, pair[side], 12))
    assert sorted(seen) == sorted(p["prompt"] for p in pairs)


def ids_of(batch, records) -> list[int]:
    """Record ids of the rows of an SFT batch, found from their tokens."""
    by_tokens = {
        tuple(ref_row(r["prompt"], r["completion"], 12)["tokens"]): r["id"] for r in records
    }
    return [by_tokens[tuple(row)] for row in batch["tokens"]]


def test_epochs_reshuffle_deterministically():
    records = sft_records(12)
    ds = sft_dataset(records, tok, max_length=12, batch_size=4, seed=7)
    stream = [ids_of(b, records) for b in itertools.islice(iter(ds), 9)]
    flat = [i for batch in stream for i in batch]
    epochs = [flat[k * 12 : (k + 1) * 12] for k in range(3)]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert epochs[0] != list(range(12))
    again = [ids_of(b, records) for b in itertools.islice(iter(ds), 3)]
    assert again == stream[:3]
    other = sft_dataset(records, tok, max_length=12, batch_size=4, seed=8)
    assert [ids_of(b, records) for b in itertools.islice(iter(other), 3)] != stream[:3]
    ordered = sft_dataset(records, tok, max_length=12, batch_size=4, shuffle=False)
    in_order = [i for b in itertools.islice(iter(ordered), 6) for i in ids_of(b, records)]
    assert in_order == list(range(12)) * 2


def test_finite_epochs_and_remainder():
    records = sft_records(10)
    ds = sft_dataset(records, tok, max_length=12, batch_size=4, num_epochs=2)
    batches = list(ds)
    # 20 examples: 5 full batches, the third spanning the epoch boundary.
    assert len(batches) == 5 and all(b["tokens"].shape == (4, 12) for b in batches)
    flat = [i for b in batches for i in ids_of(b, records)]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    one = sft_dataset(records, tok, max_length=12, batch_size=4, shuffle=False, num_epochs=1)
    assert [b["tokens"].shape[0] for b in one] == [4, 4]
    partial = sft_dataset(
        records,
        tok,
        max_length=12,
        batch_size=4,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
    )
    assert [b["tokens"].shape[0] for b in partial] == [4, 4, 2]


def test_iterator_state_resumes_the_same_stream():
    consumed = 3  # 10 records, batches of 4: the third batch crosses into epoch 2
    records = sft_records(10)
    ds = sft_dataset(records, tok, max_length=12, batch_size=4, seed=11)
    it = iter(ds)
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(2)]
    resumed = iter(ds)
    resumed.set_state(state)
    for want in expected:
        assert_batch_equal(next(resumed), want)
    # A fresh dataset object built from the same arguments resumes too.
    rebuilt = iter(sft_dataset(records, tok, max_length=12, batch_size=4, seed=11))
    rebuilt.set_state(state)
    assert_batch_equal(next(rebuilt), expected[0])


@given(count=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=6)
def test_shards_together_are_the_unsharded_stream(count, seed):
    """Shard p's batch k is rows [p b, (p + 1) b) of the unsharded batch k, across epochs;
    a shard's iterator state resumes it."""
    records = sft_records(10)
    whole = iter(sft_dataset(records, tok, max_length=12, batch_size=8, seed=seed))
    shards = [
        iter(sft_dataset(records, tok, max_length=12, batch_size=8, seed=seed, shard=(p, count)))
        for p in range(count)
    ]
    for _ in range(4):  # 32 rows: three epochs of 10 records
        parts = [next(shard) for shard in shards]
        assert {len(part["tokens"]) for part in parts} == {8 // count}
        joined = {k: np.concatenate([part[k] for part in parts]) for k in KEYS}
        assert_batch_equal(joined, next(whole))
    state = shards[-1].get_state()
    expected = next(shards[-1])
    resumed = iter(
        sft_dataset(records, tok, max_length=12, batch_size=8, seed=seed, shard=(count - 1, count))
    )
    resumed.set_state(state)
    assert_batch_equal(next(resumed), expected)


def test_packed_shards_use_every_example_once_per_epoch():
    """Packed, shard p packs every count-th example of the stream: the two shards' rows hold
    each record exactly once in an epoch's worth of rows."""
    records = sft_records(12)
    kwargs = dict(max_length=40, batch_size=4, seed=3, packing=True, max_segments=8)
    rows = []
    for p in range(2):
        shard = sft_dataset(records, tok, num_epochs=1, **kwargs, shard=(p, 2))
        for batch in shard:
            assert len(batch["tokens"]) == 2
            for row, segments in zip(batch["tokens"], batch["segment_ids"], strict=True):
                rows += [tok.decode(row[segments == s]) for s in range(1, segments.max() + 1)]
    expected = sorted(r["prompt"] + r["completion"] for r in records)
    assert sorted(rows) == expected


def test_shard_errors():
    records = sft_records(4)
    with raises_naming("batch_size=3", "2 equal shards", error=ValueError):
        sft_dataset(records, tok, max_length=12, batch_size=3, shard=(0, 2))
    with raises_naming("index", error=ValueError):
        sft_dataset(records, tok, max_length=12, batch_size=2, shard=(2, 2))
    with raises_naming("drop_remainder=True", error=ValueError):
        sft_dataset(records, tok, max_length=12, batch_size=2, shard=(0, 2), drop_remainder=False)


def test_orbax_checkpoint_round_trip(tmp_path):
    import grain
    import orbax.checkpoint as ocp

    pairs = preference_pairs(arithmetic_split(num_train=9, num_heldout=0)[0], seed=0)
    ds = preference_dataset(pairs, tok, max_length=12, batch_size=2, seed=1)
    it = iter(ds)
    for _ in range(6):
        next(it)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(6, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
        expected = [next(it) for _ in range(3)]
        restored = iter(ds)
        manager.restore(
            6, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored))
        )
    for want in expected:
        assert_batch_equal(next(restored), want)


def test_skip_drops_invalid_records(caplog):
    records = [
        {"prompt": "1+1=", "completion": "2"},
        {"prompt": "1+1="},
        3,
        {"prompt": "2+2=", "completion": "4"},
    ]
    with caplog.at_level(logging.WARNING, logger="tunelib.data"):
        ds = sft_dataset(
            records, tok, max_length=8, batch_size=2, shuffle=False, num_epochs=1, on_invalid="skip"
        )
    assert "2 invalid records" in caplog.text
    (batch,) = list(ds)
    assert [tok.decode(row) for row in batch["tokens"]] == ["1+1=2", "2+2=4"]
    with raises_naming("record 1", "'completion'", error=RecordError):
        sft_dataset(records, tok, max_length=8, batch_size=2)


def test_dataset_argument_errors():
    records = sft_records(3)
    with raises_naming("no valid sft record", error=ValueError):
        sft_dataset([5], tok, max_length=12, batch_size=1, on_invalid="skip")
    with raises_naming("batch_size=4", "num_epochs=1", error=ValueError):
        sft_dataset(records, tok, max_length=12, batch_size=4, num_epochs=1)
    assert len(list(sft_dataset(records, tok, max_length=12, batch_size=4, num_epochs=2))) == 1
    with raises_naming("batch_size", error=ValueError):
        sft_dataset(records, tok, max_length=12, batch_size=0)
    with raises_naming("num_epochs", error=ValueError):
        sft_dataset(records, tok, max_length=12, batch_size=1, num_epochs=0)
    with raises_naming("seed", error=ValueError):
        preference_dataset([], tok, max_length=12, batch_size=1, seed=-1)
    with raises_naming("max_length", error=ValueError):
        sft_dataset(records, tok, max_length=0, batch_size=1)
    with raises_naming("on_invalid"):
        preference_dataset([], tok, max_length=12, batch_size=1, on_invalid="ignore")
    with own_checks(), raises_naming("on_invalid", "'ignore'", error=ValueError):
        preference_dataset([], tok, max_length=12, batch_size=1, on_invalid="ignore")


def test_encode_prompts_left_pads():
    tokens, where = encode_prompts(["12+7=", "3+4=", ""], tok, max_length=8)
    np.testing.assert_array_equal(
        tokens,
        np.array(
            [
                [PAD, PAD, BOS, 4, 5, 13, 10, 16],
                [PAD, PAD, PAD, BOS, 6, 13, 7, 16],
                [PAD] * 7 + [BOS],
            ],
            np.int32,
        ),
    )
    np.testing.assert_array_equal(where, tokens != PAD)
    assert tokens.dtype == np.int32 and where.dtype == np.bool_
    exact, exact_where = encode_prompts(["1234567"], tok, max_length=8)
    assert exact[0, 0] == BOS and exact_where.all()
    empty, empty_where = encode_prompts([], tok, max_length=4)
    assert empty.shape == empty_where.shape == (0, 4)


@given(st.lists(st.text(alphabet="0123456789+-*=", max_size=7), max_size=5))
def test_encode_prompts_matches_reference(prompts):
    tokens, where = encode_prompts(prompts, tok, max_length=8)
    for row, mask, prompt in zip(tokens, where, prompts, strict=True):
        ids = [BOS, *tok.encode(prompt)]
        assert list(row) == [PAD] * (8 - len(ids)) + ids
        assert list(mask) == [False] * (8 - len(ids)) + [True] * len(ids)


def test_encode_prompts_errors():
    with raises_naming("prompts[1]", "9 tokens", "max_length=8", error=ValueError):
        encode_prompts(["1", "12345678"], tok, max_length=8)
    with raises_naming("prompts[0]", "'#'", error=ValueError):
        encode_prompts(["1#"], tok, max_length=8)
    with own_checks(), raises_naming("prompts[0]", "int", error=TypeError):
        encode_prompts([12], tok, max_length=8)
    with raises_naming("max_length", error=ValueError):
        encode_prompts(["1"], tok, max_length=0)


def assert_row(batch, row, expected):
    for key in KEYS:
        assert batch[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(batch[key][row], expected[key], err_msg=key)


def test_sft_batches_of_chat_text_and_prompt_completion(hf_tok, bos_tok):
    records = [SFT_CHAT, SFT_TEXT, SFT_CHAT_PAIR]
    batch = next(iter(sft_dataset(records, hf_tok, max_length=96, batch_size=3, shuffle=False)))
    assert {k: v.shape for k, v in batch.items()} == {k: (3, 96) for k in KEYS}
    ids, where = encode_chat(hf_tok, SFT_CHAT["messages"])
    assert_row(batch, 0, ref_ids_row(ids, where, 96, hf_tok.pad_id))
    # The chat pair trains on the same tokens as the conversation it is a split of (the
    # template's generation blocks mark the answer either way).
    pair_ids, pair_where = encode_chat(hf_tok, [USER, ANSWER], prompt_length=1)
    np.testing.assert_array_equal(pair_ids, ids)
    np.testing.assert_array_equal(pair_where, where)
    assert_row(batch, 2, ref_ids_row(ids, where, 96, hf_tok.pad_id))
    # Strings: prompt then completion tokenized separately, EOS the last target, no BOS here.
    prompt, completion = hf_tok.encode(SFT_TEXT["prompt"]), hf_tok.encode(SFT_TEXT["completion"])
    text_ids = [*prompt, *completion, hf_tok.eos_id]
    text_where = [False] * len(prompt) + [True] * (len(completion) + 1)
    assert_row(batch, 1, ref_ids_row(text_ids, text_where, 96, hf_tok.pad_id))
    # The chat targets are exactly the assistant answer and its end of turn.
    targets = batch["targets"][0][batch["where"][0]]
    assert hf_tok.decode(targets, stop_at_eos=False) == ANSWER["content"]
    assert targets[-1] == hf_tok.eos_id  # <|im_end|>
    # A tokenizer whose post-processor adds BOS starts string sequences with it.
    bos_batch = next(iter(sft_dataset([SFT_TEXT], bos_tok, max_length=32, batch_size=1)))
    assert bos_batch["tokens"][0, 0] == bos_tok.bos_id
    assert_row(bos_batch, 0, ref_ids_row([bos_tok.bos_id, *text_ids], [False, *text_where], 32, 0))


def test_masks_from_a_template_without_generation_blocks(tmp_path, hf_tok):
    directory = write_tokenizer(tmp_path / "plain", chat_template=PLAIN_CHAT_TEMPLATE)
    plain = HFTokenizer.from_directory(directory)
    (batch,) = sft_dataset([SFT_CHAT, SFT_CHAT_PAIR], plain, max_length=96, batch_size=2,
                              num_epochs=1, shuffle=False)  # fmt: skip
    for row in range(2):  # the turn, its end and the blank line before the next turn
        targets = batch["targets"][row][batch["where"][row]]
        assert hf_tok.decode(targets, stop_at_eos=False) == ANSWER["content"] + "\n\n"
        assert hf_tok.eos_id in targets.tolist()


def test_preference_batches(hf_tok):
    ds = preference_dataset([PREFERENCE_TEXT, PREFERENCE_CHAT], hf_tok, max_length=80, batch_size=2,
                               shuffle=False)  # fmt: skip
    batch = next(iter(ds))
    for side, response in (("chosen", ANSWER), ("rejected", WRONG)):
        ids, where = encode_chat(hf_tok, [USER, response], prompt_length=1)
        assert_row(batch[side], 1, ref_ids_row(ids, where, 80, hf_tok.pad_id))
        targets = batch[side]["targets"][1][batch[side]["where"][1]]
        assert hf_tok.decode(targets, stop_at_eos=False) == response["content"]
    n_prompt = len(hf_tok.encode(PREFERENCE_TEXT["prompt"]))
    chosen = batch["chosen"]
    assert chosen["where"][0].sum() == len(hf_tok.encode("4")) + 1
    assert not chosen["where"][0, : n_prompt - 1].any() and chosen["where"][0, n_prompt - 1]
    np.testing.assert_array_equal(
        chosen["tokens"][0, :n_prompt], batch["rejected"]["tokens"][0, :n_prompt]
    )


def test_too_long_and_template_errors_raise_or_skip(hf_tok, caplog):
    long = {"messages": [USER, {"role": "assistant", "content": "the quick brown fox " * 10}]}
    with raises_naming("record 1", "'messages'", "max_length=40", error=RecordError) as info:
        encode_records([SFT_CHAT, long], hf_tok, kind="sft", max_length=40)
    assert info.value.reason == "too_long"
    no_template = HFTokenizer(hf_tok.tokenizer, eos_token="<|im_end|>")
    with raises_naming("record 0", "no chat template", error=RecordError):
        encode_records([PREFERENCE_CHAT], no_template, kind="preference", max_length=40)
    records = [SFT_CHAT, long, 3, SFT_TEXT]
    examples, report = encode_records(records, hf_tok, kind="sft", max_length=40, on_invalid="skip")
    assert len(examples) == 2 and dict(report.skipped) == {"too_long": 1, "not_a_dict": 1}
    with caplog.at_level("WARNING"):
        ds = sft_dataset([SFT_CHAT, long], hf_tok, max_length=40, batch_size=1, on_invalid="skip")
    assert "skipped 1 invalid records" in caplog.text and "too_long" in caplog.text
    assert len(list(itertools.islice(ds, 3))) == 3
    with raises_naming("no valid sft record", error=ValueError):
        sft_dataset([long], hf_tok, max_length=40, batch_size=1, on_invalid="skip")


def test_prompts_for_sampling(hf_tok, bos_tok):
    tokens, where = encode_prompts(["2 + 2 =", [USER]], bos_tok, max_length=48)
    first = [bos_tok.bos_id, *bos_tok.encode("2 + 2 =")]
    assert tokens[0, -len(first) :].tolist() == first and where[0].sum() == len(first)
    chat, _ = encode_chat(bos_tok, [USER], add_generation_prompt=True)
    assert tokens[1, -len(chat) :].tolist() == chat.tolist() and where[1].sum() == len(chat)
    assert hf_tok.decode(tokens[1][where[1]], stop_at_eos=False).endswith("assistant\n")
    with raises_naming("prompts[1]", "max_length=10", error=ValueError):
        encode_prompts(["2", [USER]], hf_tok, max_length=10)
    with raises_naming("prompts[0]", "role", error=ValueError):
        encode_prompts([[{"role": "bot", "content": "x"}]], hf_tok, max_length=10)
    with raises_naming("prompts[0]", "no token", error=ValueError):
        encode_prompts([""], hf_tok, max_length=10)


def test_deprecated_names_of_the_hugging_face_pipelines(hf_tok):
    import tunelib.data

    with pytest.warns(DeprecationWarning, match="hf_sft_dataset.*sft_dataset"):
        hf_sft_dataset = tunelib.data.hf_sft_dataset
    with pytest.warns(DeprecationWarning, match="hf_preference_dataset.*preference_dataset"):
        hf_preference_dataset = tunelib.data.hf_preference_dataset
    with pytest.warns(DeprecationWarning, match="hf_prompts.*encode_prompts"):
        hf_prompts = tunelib.data.hf_prompts
    with pytest.warns(DeprecationWarning, match="encode_hf_records.*encode_records"):
        encode_hf_records = tunelib.data.encode_hf_records
    args = dict(max_length=64, batch_size=2, shuffle=False, num_epochs=1)
    old, new = (
        next(iter(f([SFT_CHAT, SFT_TEXT], hf_tok, **args))) for f in (hf_sft_dataset, sft_dataset)
    )
    assert_batch_equal(old, new)
    pairs = [PREFERENCE_TEXT, PREFERENCE_CHAT]
    old, new = (
        next(iter(f(pairs, hf_tok, **args))) for f in (hf_preference_dataset, preference_dataset)
    )
    assert_batch_equal(old, new)
    prompts = ["2 + 2 =", [USER]]
    for a, b in zip(
        hf_prompts(prompts, hf_tok, max_length=40),
        encode_prompts(prompts, hf_tok, max_length=40),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    old, _ = encode_hf_records(pairs, hf_tok, kind="preference", max_length=64)
    new, _ = encode_records(pairs, hf_tok, kind="preference", max_length=64)
    for a, b in zip(old, new, strict=True):
        for side in ("chosen", "rejected"):
            np.testing.assert_array_equal(a[side]["ids"], b[side]["ids"])
            np.testing.assert_array_equal(a[side]["where"], b[side]["where"])
    names = {"hf_sft_dataset", "hf_preference_dataset", "hf_prompts", "encode_hf_records"}
    assert names.isdisjoint(tunelib.data.__all__)

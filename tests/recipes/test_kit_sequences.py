"""`kit.data`'s layouts between SFT rows and the sampler's prompts and completions, which
on-policy distillation crosses every sampled step."""

import json
import re
import types

import jax
import numpy as np
import pytest

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)
from tunelib.data import CharTokenizer, encode_prompts, sft_dataset

from kit import data

RECORDS = [
    {"prompt": "12+7=", "completion": "19"},
    {"prompt": "3+4=", "completion": "7"},
    {"prompt": "55+66=", "completion": "121"},
]


def rows_of(records, width=12):
    dataset = sft_dataset(
        records, CharTokenizer(), max_length=width, batch_size=len(records), shuffle=False,
        num_epochs=1,
    )  # fmt: skip
    return next(iter(dataset))


def test_the_prompts_of_sft_rows_are_the_samplers_prompts():
    tokenizer, prompt_length = CharTokenizer(), 9
    tokens, where = data.prompts_of_rows(rows_of(RECORDS), prompt_length)
    expected = encode_prompts([r["prompt"] for r in RECORDS], tokenizer, max_length=9)
    np.testing.assert_array_equal(where, expected[1])
    np.testing.assert_array_equal(np.where(where, tokens, -1), np.where(*expected[::-1], -1))


def test_prompts_and_completions_become_the_rows_of_their_sequences():
    """A prompt and its completion (answer, then EOS), as the sampler lays them out, give the
    SFT row of the same record: the same inputs and targets on the real positions."""
    tokenizer = CharTokenizer()
    prompts = encode_prompts([r["prompt"] for r in RECORDS], tokenizer, max_length=9)
    tokens, where = np.zeros((3, 5), np.int32), np.zeros((3, 5), bool)
    for i, r in enumerate(RECORDS):
        ids = [*tokenizer.encode(r["completion"]), tokenizer.eos_id]
        tokens[i, : len(ids)], where[i, : len(ids)] = ids, True
    rows = data.sequences_of_completions(*prompts, tokens, where)
    expected = rows_of(RECORDS)
    for i in range(3):
        real = np.asarray(rows["attention_where"][i])
        n = int(expected["attention_where"][i].sum())
        np.testing.assert_array_equal(rows["tokens"][i][real][:n], expected["tokens"][i][:n])
        np.testing.assert_array_equal(
            np.asarray(rows["targets"][i])[np.asarray(rows["where"][i])],
            expected["targets"][i][expected["where"][i]],
        )


def text_model(tokenizer, context: int = 2048):
    """What `kit.data.load_task` reads of a `kit.models.Model` reading text: its tokenizer,
    no image layout, and its context."""
    config = types.SimpleNamespace(max_position_embeddings=context)
    return types.SimpleNamespace(tokenizer=tokenizer, images=None, config=config)


def test_the_built_in_task_without_held_out_problems_sizes_completions_by_its_training_ones():
    """`--num-heldout 0`: no held-out problems, and completions long enough for the longest
    training answer (the held-out answers set it when there are some)."""
    from kit.grpo_config import GRPOConfig

    tokenizer = CharTokenizer()
    model = text_model(tokenizer)
    none_held = data.load_task(GRPOConfig(num_heldout=0, num_train=64), "rl", model)
    assert none_held.problems == [] and len(none_held.train) == 64
    longest = max(len(tokenizer.encode(r["answer"])) for r in none_held.train)
    assert none_held.max_new_tokens > longest
    held = data.load_task(GRPOConfig(num_heldout=20, num_train=64), "rl", model)
    longest = max(len(tokenizer.encode(r["answer"])) for r in held.problems)
    assert len(held.problems) == 20 and held.max_new_tokens > longest


@pytest.mark.parametrize("kind", ["sft", "preference"])
def test_the_held_out_batches_have_one_shape_and_the_padding_no_tokens(kind):
    """23 held-out records in batches of 8: three batches of 8 rows, the last with 7 real
    rows and one empty row (False in every mask), so an evaluation compiles one program."""
    from kit import parallel
    from kit.grpo_config import GRPOConfig

    config = GRPOConfig(num_heldout=23, num_train=64, batch_size=8)
    task = data.load_task(config, kind, text_model(CharTokenizer()))
    batches = data.heldout_batches(task, parallel.placement(8, 1), batch_size=8, kind=kind)
    shapes = {tuple(x.shape for x in jax.tree.leaves(b)) for b in batches}
    assert len(batches) == 3 and len(shapes) == 1
    masks = [b["where"] if kind == "sft" else b["chosen"]["where"] for b in batches]
    real_rows = [int(np.asarray(m).any(axis=1).sum()) for m in masks]
    assert real_rows == [8, 8, 7]
    last = jax.tree.leaves(jax.tree.map(lambda x: np.asarray(x)[7], batches[-1]))
    assert all(not x.any() for x in last)


def test_sequences_longer_than_the_context_are_refused_naming_the_flag(tmp_path):
    """Training sequences (`--max-length`) longer than the model's context are refused as
    the task loads; a sampled prompt with its completion (`--max-new-tokens`) as its
    prompts are laid out, from the prompts' real lengths (a prompt cap of the context
    itself is fine)."""
    from kit.errors import UserError
    from kit.grpo_config import GRPOConfig

    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({**r, "completion": r["answer"]}) + "\n" for r in records))
    model = text_model(CharTokenizer(), context=64)
    config = GRPOConfig(data=path, num_heldout=4, batch_size=4, max_length=65)
    with pytest.raises(UserError, match=re.escape("sequences of 65 tokens (--max-length) are")):
        data.load_task(config, "sft", model, data=path)
    config = GRPOConfig(data=path, num_heldout=4, batch_size=4, max_length=64)
    task = data.load_task(config, "rl", model, data=path, max_new_tokens=62)
    with pytest.raises(UserError, match=r"a prompt of \d+ tokens and completions of 62 .* of 64"):
        data.prompt_inputs(task, task.problems)
    task = data.load_task(config, "rl", model, data=path, max_new_tokens=32)
    _, where, _ = data.prompt_inputs(task, task.problems)
    assert int(where.sum(axis=1).max()) + 32 <= 64

"""The recipes' reward model (`recipes/kit/reward_model.py`): one sequence, one reward, in
the layout it is trained on (preference rows) and the one it scores rollouts in (left-padded
prompts, right-padded completions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)
from tunelib.models import Decoder, DecoderConfig

from kit import reward_model
from kit.errors import UserError


@pytest.fixture(scope="module")
def decoder():
    config = DecoderConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, head_dim=8, dtype="float32",
    )  # fmt: skip
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    head = reward_model.init_head(config.hidden_size, seed=0)
    return graphdef, params, head


def reference_score(graphdef, params, head, ids) -> float:
    """The hidden state after the whole unpadded sequence, times the head."""
    hidden = nnx.merge(graphdef, params)(jnp.asarray([ids]))
    return float(hidden[0, -1] @ head)


def test_training_rows_and_rollouts_give_each_sequence_the_same_reward(decoder):
    graphdef, params, head = decoder
    prompts, completions = [[3, 4, 5], [7, 8]], [[9, 10, 1], [11, 1]]
    sequences = [p + c for p, c in zip(prompts, completions, strict=True)]
    expected = [reference_score(graphdef, params, head, ids) for ids in sequences]

    # Preference rows: inputs ids[:-1], targets ids[1:], right-padded to 8 columns; chosen and
    # rejected sides are the two sequences, then the same two swapped.
    def rows(seqs):
        tokens, targets, where = np.zeros((2, 8), int), np.zeros((2, 8), int), np.zeros((2, 8))
        for i, ids in enumerate(seqs):
            n = len(ids) - 1
            tokens[i, :n], targets[i, :n], where[i, :n] = ids[:-1], ids[1:], 1
        return {"tokens": tokens, "targets": targets, "attention_where": where.astype(bool),
                "where": where.astype(bool)}  # fmt: skip

    batch = {"chosen": rows(sequences), "rejected": rows(sequences[::-1])}
    chosen, rejected, real = reward_model.pair_scores(graphdef, params, head, batch)
    np.testing.assert_allclose(chosen, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rejected, expected[::-1], rtol=1e-5, atol=1e-6)
    assert real.tolist() == [True, True]

    # Rollouts: prompts left-padded to 4, two completions per prompt right-padded to 5 (the
    # second of each group is empty: its reward is read after the prompt alone).
    prompt_tokens, prompt_where = np.zeros((2, 4), int), np.zeros((2, 4), bool)
    for i, p in enumerate(prompts):
        prompt_tokens[i, 4 - len(p) :], prompt_where[i, 4 - len(p) :] = p, True
    tokens, where = np.zeros((4, 5), int), np.zeros((4, 5), bool)
    for i, c in enumerate(completions):
        tokens[2 * i, : len(c)], where[2 * i, : len(c)] = c, True
    scores = reward_model.completion_scores(
        graphdef, params, head, prompt_tokens, prompt_where, tokens, where
    )
    alone = [reference_score(graphdef, params, head, p) for p in prompts]
    np.testing.assert_allclose(
        scores, [expected[0], alone[0], expected[1], alone[1]], rtol=1e-5, atol=1e-6
    )


def test_a_row_without_tokens_gets_zero(decoder):
    graphdef, params, head = decoder
    out = reward_model.scores(graphdef, params, head, np.zeros((2, 3), int), np.zeros((2, 3)) > 0)
    assert out.tolist() == [0.0, 0.0]


def test_a_saved_reward_model_loads_back_and_wrong_folders_are_one_line(tmp_path):
    from tunelib.data import CharTokenizer

    from kit import models

    model = models.new_model(CharTokenizer(), "student", seed=0)
    head = reward_model.init_head(model.config.hidden_size, seed=3)
    reward_model.save(tmp_path / "run" / "model", model, model.params, head)
    loaded = reward_model.load(tmp_path / "run")  # the run folder, or its model/
    np.testing.assert_array_equal(loaded.head, head)
    for saved, back in zip(
        jax.tree.leaves(model.params), jax.tree.leaves(loaded.model.params), strict=True
    ):
        np.testing.assert_array_equal(saved, back)

    with pytest.raises(UserError, match="no such folder"):
        reward_model.check_folder(tmp_path / "missing")
    with pytest.raises(UserError, match=r"no score\.safetensors there"):
        reward_model.check_folder(tmp_path)
    models.save_model(tmp_path / "other" / "model", model, model.params)
    (tmp_path / "other" / "model" / reward_model.HEAD_FILE).write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="unreadable"):
        reward_model.load(tmp_path / "other")

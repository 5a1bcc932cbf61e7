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


def reference_score(graphdef, params, head, ids, completion_length, pooling) -> float:
    """The head times the hidden state after the whole unpadded sequence, or the mean of the
    head times the hidden states of its last `completion_length` tokens (0 without any)."""
    per_token = np.asarray(nnx.merge(graphdef, params)(jnp.asarray([ids]))[0] @ head)
    if pooling == "last":
        return float(per_token[-1])
    return float(per_token[len(ids) - completion_length :].mean()) if completion_length else 0.0


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_training_rows_and_rollouts_give_each_sequence_the_same_reward(decoder, pooling):
    graphdef, params, head = decoder
    prompts, completions = [[3, 4, 5], [7, 8]], [[9, 10, 1], [11, 1]]
    expected = [
        reference_score(graphdef, params, head, p + c, len(c), pooling)
        for p, c in zip(prompts, completions, strict=True)
    ]

    # Preference rows: inputs ids[:-1], targets ids[1:], right-padded to 8 columns, `where`
    # on the completion's targets; chosen and rejected sides are the two sequences, then the
    # same two swapped.
    def rows(pairs):
        tokens, targets = np.zeros((2, 8), int), np.zeros((2, 8), int)
        attention, where = np.zeros((2, 8), bool), np.zeros((2, 8), bool)
        for i, (p, c) in enumerate(pairs):
            ids, n = p + c, len(p + c) - 1
            tokens[i, :n], targets[i, :n], attention[i, :n] = ids[:-1], ids[1:], True
            where[i, len(p) - 1 : n] = True
        return {"tokens": tokens, "targets": targets, "attention_where": attention,
                "where": where}  # fmt: skip

    pairs = list(zip(prompts, completions, strict=True))
    batch = {"chosen": rows(pairs), "rejected": rows(pairs[::-1])}
    chosen, rejected, real = reward_model.pair_scores(
        graphdef, params, head, batch, pooling=pooling
    )
    np.testing.assert_allclose(chosen, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rejected, expected[::-1], rtol=1e-5, atol=1e-6)
    assert real.tolist() == [True, True]

    # Rollouts: prompts left-padded to 4, two completions per prompt right-padded to 5 (the
    # second of each group is empty: its reward is read after the prompt alone, or is 0).
    prompt_tokens, prompt_where = np.zeros((2, 4), int), np.zeros((2, 4), bool)
    for i, p in enumerate(prompts):
        prompt_tokens[i, 4 - len(p) :], prompt_where[i, 4 - len(p) :] = p, True
    tokens, where = np.zeros((4, 5), int), np.zeros((4, 5), bool)
    for i, c in enumerate(completions):
        tokens[2 * i, : len(c)], where[2 * i, : len(c)] = c, True
    scores = reward_model.completion_scores(
        graphdef, params, head, prompt_tokens, prompt_where, tokens, where, pooling=pooling
    )
    alone = [reference_score(graphdef, params, head, p, 0, pooling) for p in prompts]
    np.testing.assert_allclose(
        scores, [expected[0], alone[0], expected[1], alone[1]], rtol=1e-5, atol=1e-6
    )


def test_a_row_without_tokens_gets_zero(decoder):
    graphdef, params, head = decoder
    tokens, nothing = np.zeros((2, 3), int), np.zeros((2, 3), bool)
    for pooling in ("last", "mean"):
        out = reward_model.scores(graphdef, params, head, tokens, nothing, nothing, pooling=pooling)
        assert out.tolist() == [0.0, 0.0]


def test_a_saved_reward_model_loads_back_and_wrong_folders_are_one_line(tmp_path):
    from tunelib.data import CharTokenizer

    from kit import models

    model = models.new_model(CharTokenizer(), "student", seed=0)
    head = reward_model.init_head(model.config.hidden_size, seed=3)
    reward_model.save(tmp_path / "run" / "model", model, model.params, head, pooling="mean")
    loaded = reward_model.load(tmp_path / "run")  # the run folder, or its model/
    np.testing.assert_array_equal(loaded.head, head)
    assert loaded.pooling == "mean"
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

"""Packed sequences: `segment_ids` keep them apart in attention, positions and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_close
from tests.models.test_decoder import build, forward, make_config
from tunelib.logprobs import token_logps
from tunelib.models._decoder import _default_positions

SEQUENCES = [[3, 17, 9, 30], [5, 12, 7], [8, 1], [14, 2, 26, 19, 11], [6, 21, 4, 10]]
# Row 0 packs sequences 0, 1, 2; row 1 packs 3 and 4; the last column of each is padding
# (segment 0), with an id outside the vocabulary that must be ignored.
LAYOUT = [[0, 1, 2], [3, 4]]
WIDTH, LONGEST = 10, 5


def packed_batch():
    tokens = np.full((2, WIDTH), -100)
    segments = np.zeros((2, WIDTH), np.int32)
    starts = {}
    for row, members in enumerate(LAYOUT):
        column = 0
        for segment, i in enumerate(members, start=1):
            n = len(SEQUENCES[i])
            tokens[row, column : column + n] = SEQUENCES[i]
            segments[row, column : column + n] = segment
            starts[i] = (row, column)
            column += n
    return tokens, segments, starts


def unpacked_batch():
    tokens = np.zeros((len(SEQUENCES), LONGEST), np.int64)
    where = np.zeros(tokens.shape, bool)
    for i, sequence in enumerate(SEQUENCES):
        tokens[i, : len(sequence)] = sequence
        where[i, : len(sequence)] = True
    return tokens, where


def next_token_targets(tokens, same_sequence):
    """Each column's next token as its target, counted where it belongs to the same sequence."""
    return np.where(same_sequence, tokens[:, 1:], 0), same_sequence


def loss_and_outputs(model, with_grads: bool):
    """A jitted `(tokens, where, segment_ids, targets, target_where) -> (loss, hidden, logits,
    grads)`, the loss being minus the summed next-token log-probs (grads None unless
    `with_grads`: compiling the backward pass is most of this test's time)."""
    graphdef, state = nnx.split(model)

    def loss(state, tokens, where, segment_ids, targets, target_where):
        m = nnx.merge(graphdef, state)
        hidden = m(tokens, where=where, segment_ids=segment_ids)
        logits = m.unembed(hidden)
        logps = token_logps(logits[:, :-1], targets, where=target_where)
        return -logps.sum(), (hidden, logits)

    @jax.jit
    def run(state, *batch):
        if not with_grads:
            return *loss(state, *batch), None
        (value, outputs), grads = jax.value_and_grad(loss, has_aux=True)(state, *batch)
        return value, outputs, grads

    return lambda *batch: run(state, *batch)


CONFIGS = {
    # Python loop over layers, a sliding window shorter than the sequences, QK-norm, biases.
    "loop_window": (
        dict(sliding_window=3, use_qk_norm=True, attention_bias=True, head_dim=8),
        False,
    ),
    # Stacked, rematerialised layers, with gradients.
    "scan_remat": (dict(scan_layers=True, remat=True), True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_packed_row_equals_each_sequence_alone(name):
    """Compared in float64, where packing changes only the order of summation (rounding, about
    1e-15). In float32 the two batch shapes are vectorised differently: hidden states of 4
    moved by 7e-7 here, 0.7 of the tolerance of 1e-6 this test had, and by how much depends on
    the CPU."""
    overrides, with_grads = CONFIGS[name]
    with jax.enable_x64(True):
        config = make_config(**overrides, dtype="float64", param_dtype="float64")
        run = loss_and_outputs(build(config, seed=3), with_grads)
        tokens, segments, starts = packed_batch()
        same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        packed_loss, (hidden, logits), packed_grads = run(
            tokens, None, segments, *next_token_targets(tokens, same)
        )
        alone_tokens, alone_where = unpacked_batch()
        same = alone_where[:, 1:]
        alone_loss, (alone_hidden, alone_logits), alone_grads = run(
            alone_tokens, alone_where, None, *next_token_targets(alone_tokens, same)
        )
    hidden, logits = np.asarray(hidden), np.asarray(logits)
    assert hidden.dtype == logits.dtype == packed_loss.dtype == np.float64
    assert np.all(np.isfinite(hidden)) and np.all(np.isfinite(logits))
    for i, sequence in enumerate(SEQUENCES):
        row, start = starts[i]
        n = len(sequence)
        assert_close(hidden[row, start : start + n], alone_hidden[i, :n], rtol=1e-12, atol=1e-12)
        # Logits of up to 60: judged on their own scale.
        scale = max(1.0, float(np.abs(alone_logits[i, :n]).max()))
        assert_close(
            logits[row, start : start + n], alone_logits[i, :n], rtol=1e-12, atol=1e-12 * scale
        )
    assert_close(packed_loss, alone_loss, rtol=1e-12)
    if not with_grads:
        return
    # Sums of the same terms in another order: judged on the scale of each weight's gradient.
    jax.tree.map(
        lambda a, b: assert_close(a, b, rtol=1e-10, atol=1e-12 * float(np.abs(b).max())),
        nnx.to_pure_dict(packed_grads),
        nnx.to_pure_dict(alone_grads),
    )


def test_default_positions_restart_in_each_segment():
    """Positions count the real tokens before each one in its own segment: they restart at 0
    in every segment and skip padding inside one."""
    tokens, segments, _ = packed_batch()
    where = np.ones(tokens.shape, bool)
    where[0, 5] = False  # a padding slot in the middle of sequence 1
    positions = np.array([[0, 1, 2, 3, 0, 0, 1, 0, 1, 0], [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
    real = where & (segments != 0)
    np.testing.assert_array_equal(
        _default_positions(jnp.asarray(real), jnp.asarray(segments)), positions
    )
    # In the model: the defaults equal these positions, and counting the padding slot (which
    # changes the distance between the real tokens around it) would give other outputs.
    run = forward(build(make_config(), seed=4))
    default, _ = run(tokens, where, None, segments)
    explicit, _ = run(tokens, where, positions, segments)
    assert_close(np.asarray(default)[real], np.asarray(explicit)[real], rtol=0, atol=1e-6)
    counting_padding = positions.copy()
    counting_padding[0, 6] = 2
    wrong, _ = run(tokens, where, counting_padding, segments)
    assert np.max(np.abs(np.asarray(wrong)[0, 6] - np.asarray(default)[0, 6])) > 1e-3

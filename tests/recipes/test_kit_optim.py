"""The recipes' optimizer: a warmup that leaves a step to decay over, at any run length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)

from kit import optim


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("steps", [1, 2, 40])
def test_every_run_length_takes_a_finite_step(steps, schedule):
    """`--steps 1` once failed: one warmup step left the cosine schedule nothing to decay."""
    optimizer = optim.adamw(0.1, steps, schedule=schedule)
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    moved = []
    for _ in range(steps):
        updates, state = optimizer.update({"w": jnp.ones(3)}, state, params)
        assert np.all(np.isfinite(updates["w"]))
        moved.append(bool(np.all(updates["w"] < 0)))
    assert moved[-1]  # the last step moves the weights (a 1-step run learns too)


def test_updates_made_counts_the_optimizer_steps():
    """The GRPO recipe's policy version: the Adam state's count, which checkpoints keep."""
    optimizer = optim.adamw(0.1, 10)
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    assert optim.updates_made(state) == 0
    for _ in range(3):
        _, state = optimizer.update({"w": jnp.ones(3)}, state, params)
    assert optim.updates_made(state) == 3
    with pytest.raises(ValueError, match="one Adam state"):
        optim.updates_made(())


def test_the_step_writes_the_new_state_into_the_donated_one():
    """`update_step` donates the state; the initial state owns its buffers, so the model the
    parameters came from (a DPO reference, say) outlives the first step."""
    from kit import loop

    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    state = loop.initial_state(params, optim.adamw(0.1, 10), seed=0)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    assert len(set(pointers)) == len(pointers)
    assert not {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)} & set(pointers)

    def loss_fn(p, batch):
        return jnp.sum((p["w"] * batch).sum() + p["b"]) ** 2, {}

    step = optim.update_step(loss_fn, optim.adamw(0.1, 10))
    new, metrics = step(state, jnp.ones(3))
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    assert np.isfinite(float(metrics["loss"])) and optim.updates_made(new["opt_state"]) == 1

"""The recipes' optimizer: a warmup that leaves a step to decay over, at any run length."""

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

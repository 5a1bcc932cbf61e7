"""The optimizer every recipe uses: AdamW after global-norm clipping, with a warmup."""

import functools

import jax
import numpy as np
import optax


def adamw(
    learning_rate: float,
    steps: int,
    *,
    schedule: str = "cosine",
    warmup: float = 0.05,
    weight_decay: float = 0.0,
):
    """`clip_by_global_norm(1) -> adamw` at `learning_rate`, warmed up linearly over
    `warmup` of `steps`, then `"cosine"` decay to 0 or `"constant"`."""
    # At least one warmup step, but never all of them: a 1-step run has no warmup (optax's
    # cosine schedule needs a step to decay over).
    warmup_steps = min(max(1, int(steps * warmup)), max(steps - 1, 0))
    if schedule == "cosine":
        rate = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup_steps=warmup_steps, decay_steps=steps
        )
    elif warmup_steps:
        rate = optax.warmup_constant_schedule(0.0, learning_rate, warmup_steps)
    else:  # optax's warmup over 0 steps stays at its initial value, 0
        rate = optax.constant_schedule(learning_rate)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(rate, weight_decay=weight_decay))


def updates_made(opt_state) -> int:
    """The optimizer steps taken so far: the step count of `adamw`'s Adam state (restored
    with the state, so it counts on across `--resume`)."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    counts = [x.count for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    if len(counts) != 1:
        raise ValueError(f"expected one Adam state in the optimizer's state, found {len(counts)}")
    return int(np.asarray(counts[0]))


def update_step(loss_fn, optimizer):
    """The jitted step of a recipe that trains every weight with one loss:
    `step(state, batch, *frozen) -> (state, {"loss": ..., **aux})` for
    `loss_fn(params, batch, *frozen) -> (loss, aux)`. Frozen weights (a teacher) are
    `frozen`, the step's arguments: weights the loss closed over would be compiled into the
    program as constants. `state` is donated: the step writes the new weights and optimizer
    state into its buffers, so the run never holds two copies."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch, *frozen):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], batch, *frozen
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss, **aux}

    return step

"""Checks shared by the RL losses: `[B, T]` token arrays, advantages, behaviour log-probs."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from tunelib import _validation as v


def token_arrays(where: ArrayLike | None, **arrays: ArrayLike) -> tuple[list[jax.Array], jax.Array]:
    """The named arrays as `[B, T]` floats of one shape in the compute dtype, zero where masked.

    Returns the arrays in argument order and the boolean mask (all True when `where` is None).
    Zeroing masked tokens before any arithmetic keeps NaN or infinite values there out of both
    the value and the gradient.
    """
    checked = {name: v.float_array(x, name) for name, x in arrays.items()}
    for name, x in checked.items():
        if x.ndim != 2:
            raise ValueError(f"{name} must have shape [B, T], got shape {tuple(x.shape)}.")
    shape = v.same_shape(**checked)
    where = v.mask_array(where, shape)
    dtype = v.compute_dtype(*(x.dtype for x in checked.values()))
    return [jnp.where(where, x.astype(dtype), 0.0) for x in checked.values()], where


def advantages_array(advantages: ArrayLike, where: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`[B]` (one per sequence) or `[B, T]` (one per token) advantages as `[B, T]`, 0 if masked."""
    advantages = v.float_array(advantages, "advantages")
    b, t = where.shape
    if advantages.shape == (b,):
        advantages = jnp.broadcast_to(advantages[:, None], (b, t))
    elif advantages.shape != (b, t):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but must have shape ({b},) (one "
            f"per sequence) or ({b}, {t}) (one per token) to match token_logps ({b}, {t}); "
            "tunelib never broadcasts between data arrays."
        )
    dtype = v.compute_dtype(dtype, advantages.dtype)
    return jnp.where(where, advantages.astype(dtype), 0.0)


def policy_inputs(
    token_logps: ArrayLike, old_token_logps: ArrayLike | None, where: ArrayLike | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checked log-probs, behaviour log-probs (`sg(token_logps)` when None) and the mask."""
    if old_token_logps is None:
        (logps,), where = token_arrays(where, token_logps=token_logps)
        return logps, lax.stop_gradient(logps), where
    (logps, old), where = token_arrays(
        where, token_logps=token_logps, old_token_logps=old_token_logps
    )
    return logps, old, where

"""Checked `[B]` inputs and the smoothed logistic loss shared by the preference losses."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from tunelib import _validation as v


def sequence_arrays(
    where: ArrayLike | None, **arrays: ArrayLike
) -> tuple[list[jax.Array], jax.Array]:
    """The named arrays as `[B]` floats of one shape in the compute dtype, zero where masked.

    Returns the arrays in argument order and the boolean mask (all True when `where` is None).
    Zeroing masked rows before any arithmetic keeps NaN or infinite values there out of both
    the value and the gradient.
    """
    checked = {name: v.float_array(x, name) for name, x in arrays.items()}
    for name, x in checked.items():
        if x.ndim != 1:
            raise ValueError(f"{name} must have shape [B], got shape {tuple(x.shape)}.")
    shape = v.same_shape(**checked)
    where = v.mask_array(where, shape)
    dtype = v.compute_dtype(*(x.dtype for x in checked.values()))
    return [jnp.where(where, x.astype(dtype), 0.0) for x in checked.values()], where


def smoothed_logistic(logits: jax.Array, label_smoothing: ArrayLike) -> jax.Array:
    r"""$-(1 - \varepsilon) \log \sigma(x) - \varepsilon \log \sigma(-x)$, computed stably."""
    eps = jnp.asarray(label_smoothing, logits.dtype)
    return -(1 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)


def below_half(x: ArrayLike, name: str) -> None:
    """Reject a Python number outside [0, 0.5); traced values pass unchecked."""
    if isinstance(x, int | float) and not 0.0 <= x < 0.5:
        raise ValueError(f"{name} must lie in [0, 0.5), got {x}.")

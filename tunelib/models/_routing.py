"""Checks for a recorded MoE routing (`routing=`): its shape against the model and the batch,
and its expert ids against the model's experts."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from tunelib import _validation as v
from tunelib.models._config import DecoderConfig


def checked_routing(routing: ArrayLike, config: DecoderConfig, batch: tuple[int, int]) -> jax.Array:
    """`routing` as an int32 `[M, B, T, k]` array for `config`'s M mixture-of-experts layers
    and `batch` `(B, T)`, after every check that can be made when it is traced (the model has
    such layers, the shape) and, when it is concrete, its ids in `[0, E)`."""
    moe = sum(config.moe_layers)
    if not moe:
        raise ValueError(
            "routing was given, but this model has no mixture-of-experts layers "
            f"(num_experts={config.num_experts}): there is nothing to replay."
        )
    routing = v.int_array(routing, "routing")
    k, experts = config.num_experts_per_tok, config.num_experts
    expected = (moe, *batch, k)
    if routing.shape != expected:
        raise ValueError(
            f"routing has shape {routing.shape} but this model needs {expected}: [M, B, T, k] "
            f"for its M={moe} mixture-of-experts layers, tokens [B, T] = {tuple(batch)} and "
            f"k = num_experts_per_tok = {k}; a routing recorded for another model or other "
            "tokens cannot be replayed."
        )
    concrete = not isinstance(routing, jax.core.Tracer)
    if concrete and getattr(routing, "is_fully_addressable", True):
        ids = np.asarray(routing)
        if ids.size and not (ids.min() >= 0 and ids.max() < experts):
            raise ValueError(
                f"routing must hold expert ids in [0, {experts}) (num_experts={experts}), got "
                f"ids from {ids.min()} to {ids.max()}: it was recorded for another model."
            )
    return routing.astype(jnp.int32)

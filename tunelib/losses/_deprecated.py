"""Old entry points that keep working for one release, with a `DeprecationWarning`."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from tunelib import _deprecation, logprobs


def fused_distillation_loss(
    student_hidden: ArrayLike,
    student_unembedding: ArrayLike,
    teacher_hidden: ArrayLike,
    teacher_unembedding: ArrayLike,
    *,
    beta: Any = 0.5,
    temperature: Any = 1.0,
    temperature_squared: bool = True,
    **kwargs: Any,
) -> jax.Array:
    """Deprecated: ``temperature**2 * tunelib.logprobs.fused_divergence(...)``.

    The fused divergence head moved to `tunelib.logprobs.fused_divergence`, which returns the
    divergence itself (its mixture weight is `mix`); multiply by ``temperature**2`` for the
    distillation loss this function returned. Removed in tunelib 0.3.0.
    """
    _deprecation.warn(
        "tunelib.losses.fused_distillation_loss",
        "temperature**2 * tunelib.logprobs.fused_divergence(..., mix=...)",
    )
    divergence = logprobs.fused_divergence(
        student_hidden,
        student_unembedding,
        teacher_hidden,
        teacher_unembedding,
        mix=beta,
        temperature=temperature,
        **kwargs,
    )
    if not temperature_squared:
        return divergence
    return divergence * jnp.asarray(temperature, divergence.dtype) ** 2

"""Annotation aliases shared by the public functions."""

from jax.typing import ArrayLike
from jaxtyping import Real

# A hyperparameter that may be a Python number or a traced scalar (so it can be scheduled
# without recompiling).
Scalar = float | int | Real[ArrayLike, ""]

"""Annotation aliases shared by the public functions."""

from typing import ClassVar

from jax.typing import ArrayLike
from jaxtyping import AbstractDtype, Real

# A hyperparameter that may be a Python number or a traced scalar (so it can be scheduled
# without recompiling).
Scalar = float | int | Real[ArrayLike, ""]


class Mask(AbstractDtype):
    """The dtypes a mask (`where`) may have: boolean, or integer holding only 0 and 1.

    Used as `Mask[ArrayLike, "B T"]`. Integer masks (as TRL and Tunix users pass them) are
    converted by `tunelib._validation.mask_array`, which rejects other values when it can see
    them (concrete arrays).
    """

    dtypes: ClassVar[list[str]] = [
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    ]

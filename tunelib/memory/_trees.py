"""Pytrees of arrays or `jax.ShapeDtypeStruct`s as a compiled step sees them: each leaf's
shape and dtype, the bytes one device holds of it, and the abstract copy of a tree."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunelib import _validation as v

PyTree = Any


def leaf_bytes(x: Any) -> int:
    """The bytes of `x` on one device: its shard's shape when it has a sharding."""
    shape, dtype = shape_dtype(x)
    sharding = getattr(x, "sharding", None)
    if sharding is not None and shape:
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * dtype.itemsize  # a PRNG key's dtype has one too


def shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype of a leaf: an array, a `jax.ShapeDtypeStruct` or a number."""
    if isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic):
        return tuple(x.shape), x.dtype
    if v.is_real_number(x) or isinstance(x, bool | complex):
        return (), jnp.result_type(x)
    raise TypeError(
        f"expected arrays, ShapeDtypeStructs or numbers in the tree, got {type(x).__name__}."
    )


def tree_bytes(tree: PyTree) -> int:
    """The bytes one device holds of a pytree of arrays or `jax.ShapeDtypeStruct`s.

    A leaf with a sharding counts its shard on one device (`sharding.shard_shape`): a
    parameter replicated over 8 devices counts whole, one split over them an eighth. A
    leaf without one (a `ShapeDtypeStruct` without a sharding, a NumPy array, a number)
    counts whole, as `jax.jit` places it on one device.

    Args:
      tree: any pytree of arrays, `jax.ShapeDtypeStruct`s or Python numbers.

    Returns:
      The bytes, an int.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.memory import tree_bytes
      >>> params = {"w": jax.ShapeDtypeStruct((1024, 256), jnp.float32),
      ...           "b": jax.ShapeDtypeStruct((256,), jnp.bfloat16)}
      >>> tree_bytes(params)  # 1024 * 256 * 4 + 256 * 2
      1049088

    References:
      JAX, "Distributed arrays and automatic parallelization" (shardings and shard shapes),
      https://docs.jax.dev/en/latest/notebooks/Distributed_arrays_and_automatic_parallelization.html.
    """
    return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))


def abstract(tree: PyTree) -> PyTree:
    """`tree` with every array replaced by a `jax.ShapeDtypeStruct` of its shape, dtype and
    sharding: what `jax.jit(...).lower` needs, and nothing it could copy to a device."""

    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray | np.generic):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, tree)

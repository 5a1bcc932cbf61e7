"""The batch axis of a tree of arguments: its size, the multiple a sharded batch keeps, and
the arguments resized to another batch (abstract, for an ahead-of-time compilation)."""

import math
from typing import Any

import jax

from tunelib import _validation as v
from tunelib.memory._trees import PyTree, abstract, shape_dtype


def _first_axes(tree: PyTree) -> list[tuple[Any, int]]:
    """`(leaf, its first axis)` for every leaf of `tree` with a first axis."""
    out = []
    for x in jax.tree.leaves(tree):
        shape, _ = shape_dtype(x)
        if shape:
            out.append((x, shape[0]))
    return out


def batch_size(tree: PyTree) -> int:
    """The batch of a tree of batch arrays: the smallest first axis among its leaves (a
    group of G completions per prompt has `[B]` prompts and `[B * G]` rows: B)."""
    axes = [n for _, n in _first_axes(tree)]
    if not axes:
        raise ValueError("the batch has no array with a first (batch) axis.")
    size = min(axes)
    if size < 1:
        raise ValueError(f"the batch's first axes must be >= 1, got {sorted(set(axes))}.")
    for n in axes:
        if n % size:
            raise ValueError(
                f"every first axis of the batch must be a multiple of the batch size {size} "
                f"(rows per example), got {n}."
            )
    return size


def batch_multiple(tree: PyTree) -> int:
    """The batch sizes a tree can be resized to are the multiples of this: a leaf whose
    first axis is split over n devices must keep a multiple of n rows."""
    size, multiple = batch_size(tree), 1
    for x, n in _first_axes(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            continue
        shards = n // sharding.shard_shape(shape_dtype(x)[0])[0]
        per_example = n // size
        multiple = math.lcm(multiple, shards // math.gcd(shards, per_example))
    return multiple


def resize_batch(tree: PyTree, size: int) -> PyTree:
    """`tree`'s batch arrays as `jax.ShapeDtypeStruct`s of another batch size.

    Every leaf with a first axis is taken to hold the batch there: its first axis, `k`
    times the batch size (`batch_size`, the smallest first axis; k rows per example, as the
    G completions of a prompt), becomes `k * size`. Dtypes and shardings stay; leaves
    without an axis (a step counter, a key) keep their shape.

    Args:
      tree: a pytree of arrays or `jax.ShapeDtypeStruct`s, the batch on their first axis.
      size: the new batch size, >= 1, a multiple of `batch_multiple(tree)` (so a batch
        split over n devices still splits).

    Returns:
      The tree of `jax.ShapeDtypeStruct`s.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.memory import resize_batch
      >>> batch = {"prompts": jax.ShapeDtypeStruct((8, 32), jnp.int32),
      ...          "tokens": jax.ShapeDtypeStruct((64, 48), jnp.int32)}  # 8 completions each
      >>> jax.tree.map(lambda x: x.shape, resize_batch(batch, 3))
      {'prompts': (3, 32), 'tokens': (24, 48)}

    References:
      JAX, "Ahead-of-time lowering and compilation" (lowering with `ShapeDtypeStruct`s),
      https://docs.jax.dev/en/latest/aot.html.
    """
    v.static_int(size, "size")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}.")
    old, multiple = batch_size(tree), batch_multiple(tree)
    if size % multiple:
        raise ValueError(
            f"size {size} must be a multiple of {multiple}: the batch is split over devices."
        )
    tree = abstract(tree)

    def leaf(x):
        if not isinstance(x, jax.ShapeDtypeStruct) or not x.shape:
            return x
        shape = (x.shape[0] // old * size, *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(leaf, tree)
